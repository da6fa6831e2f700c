package startstop_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"fusion/outbox/startstop"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// service is the smallest user of the base: one goroutine that runs until Stop.
type service struct {
	startstop.Base
	hold chan struct{} // when set, the goroutine waits for it after Stop before finishing
}

func (s *service) Start(ctx context.Context) error {
	run, err := s.Begin()
	if err != nil {
		return err
	}
	go func() {
		defer run.Finished()
		<-run.Ctx.Done()
		if s.hold != nil {
			<-s.hold
		}
	}()
	return nil
}

func TestStopBeforeStartIsANoOpAndStartThenRefuses(t *testing.T) {
	t.Parallel()
	var s service
	require.NoError(t, s.Stop(context.Background()))
	require.NoError(t, s.Stop(context.Background()))
	require.ErrorIs(t, s.Start(context.Background()), startstop.ErrStopped)
}

func TestStartAfterStopRefusesAndStopIsIdempotent(t *testing.T) {
	t.Parallel()
	var s service
	require.NoError(t, s.Start(context.Background()))
	require.ErrorIs(t, s.Start(context.Background()), startstop.ErrStarted)
	require.NoError(t, s.Stop(context.Background()))
	require.NoError(t, s.Stop(context.Background()))
	require.ErrorIs(t, s.Start(context.Background()), startstop.ErrStopped)
	<-s.Done()
}

func TestStopIsBoundedByItsContext(t *testing.T) {
	t.Parallel()
	s := service{hold: make(chan struct{})}
	require.NoError(t, s.Start(context.Background()))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := s.Stop(ctx)
	require.ErrorIs(t, err, context.Canceled)
	select {
	case <-s.Abandoned():
	default:
		t.Fatal("Abandoned is not closed after a Stop whose context ended")
	}
	require.Equal(t, ctx, s.StopContext(), "the first Stop's context bounds the shutdown")
	close(s.hold)
	require.NoError(t, s.Stop(context.Background()), "a later Stop waits for the run")
}

func TestFailedStartCanBeRetriedAndStopDuringStartUpCancelsIt(t *testing.T) {
	t.Parallel()
	var b startstop.Base
	run, err := b.Begin()
	require.NoError(t, err)
	run.Failed()
	run.Failed() // once only
	run, err = b.Begin()
	require.NoError(t, err, "a failed start-up leaves the service startable")

	startCtx, release := run.StartContext(context.Background())
	defer release()
	stopped := make(chan error)
	go func() { stopped <- b.Stop(context.Background()) }()
	<-startCtx.Done() // the start-up sees the Stop
	require.True(t, run.Stopping())
	run.Failed() // a start-up given up because of Stop: the service stays stopped
	require.NoError(t, <-stopped)
	_, err = b.Begin()
	require.ErrorIs(t, err, startstop.ErrStopped)
}

// TestCompetingStartAndStop runs Starts and Stops at once: whatever the interleaving, at most
// one Start succeeds, every Start after the first Stop refuses, every Stop returns and no
// goroutine is left running (goleak).
func TestCompetingStartAndStop(t *testing.T) {
	t.Parallel()
	for range 200 {
		var s service
		var wg sync.WaitGroup
		var mu sync.Mutex
		var started int
		stopReturned := make(chan struct{}, 4)
		begin := make(chan struct{})
		for range 4 {
			wg.Add(2)
			go func() {
				defer wg.Done()
				<-begin
				err := s.Start(context.Background())
				if err == nil {
					mu.Lock()
					started++
					mu.Unlock()
					return
				}
				if !errors.Is(err, startstop.ErrStopped) && !errors.Is(err, startstop.ErrStarted) {
					t.Errorf("Start: unexpected error %v", err)
				}
			}()
			go func() {
				defer wg.Done()
				<-begin
				if err := s.Stop(context.Background()); err != nil {
					t.Errorf("Stop: %v", err)
				}
				stopReturned <- struct{}{}
			}()
		}
		close(begin)
		wg.Wait()
		require.LessOrEqual(t, started, 1)
		require.ErrorIs(t, s.Start(context.Background()), startstop.ErrStopped)
		require.NoError(t, s.Stop(context.Background()))
		if d := s.Done(); d != nil {
			<-d
		}
	}
}
