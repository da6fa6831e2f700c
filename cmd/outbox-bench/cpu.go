package main

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// The machine is shared, so throughput moves with the neighbours' load. CPU time spent per
// delete moves much less, and on a machine where the database and its clients share two cores
// it is what bounds throughput; the write and limits cases report it next to the rates.

// processCPU is this process's user and system CPU time so far (every goroutine: the writers
// or the consumer, the driver, the bench's own listener).
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// clockTick is the unit of /proc/<pid>/stat CPU times (USER_HZ, 100 on Linux).
const clockTick = 10 * time.Millisecond

// serverCPU measures the CPU time of a PostgreSQL server running on this machine: its
// postmaster and every child (backends, WAL writer, checkpointer, autovacuum).
type serverCPU struct{ postmaster int }

// findServer locates the server behind pool; nil when it does not run here (another host, a
// container with its own process namespace).
func findServer(ctx context.Context, pool *pgxpool.Pool) *serverCPU {
	var backend int
	if err := pool.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&backend); err != nil {
		return nil
	}
	st, ok := readStat(backend)
	if !ok || st.comm != "postgres" {
		return nil
	}
	return &serverCPU{postmaster: st.ppid}
}

// ticks is the CPU time each of the server's processes has used so far, by process ID.
func (s *serverCPU) ticks() (map[int]int64, bool) {
	if s == nil {
		return nil, false
	}
	paths, err := filepath.Glob("/proc/[0-9]*/stat")
	if err != nil {
		return nil, false
	}
	out := map[int]int64{}
	for _, p := range paths {
		pid, err := strconv.Atoi(strings.TrimSuffix(strings.TrimPrefix(p, "/proc/"), "/stat"))
		if err != nil {
			continue
		}
		if st, ok := readStat(pid); ok && (pid == s.postmaster || st.ppid == s.postmaster) {
			out[pid] = st.ticks
		}
	}
	return out, true
}

// since is the CPU time the server's processes used after before: for each process running
// now, what it used since before (all of it if it started since). A process that exited
// meanwhile is not counted, so measure over phases whose connections stay open; one that ended
// just after before was taken no longer subtracts its past from the phase.
func since(before, now map[int]int64) time.Duration {
	var ticks int64
	for pid, t := range now {
		if t0, ok := before[pid]; ok && t0 <= t {
			t -= t0
		}
		ticks += t
	}
	return time.Duration(ticks) * clockTick
}

type procStat struct {
	comm  string
	ppid  int
	ticks int64 // utime + stime
}

func readStat(pid int) (procStat, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return procStat{}, false
	}
	s := string(b)
	open, closing := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
	if open < 0 || closing < open {
		return procStat{}, false
	}
	f := strings.Fields(s[closing+1:]) // f[0] is field 3 (state)
	if len(f) < 13 {
		return procStat{}, false
	}
	ppid, _ := strconv.Atoi(f[1])
	utime, _ := strconv.ParseInt(f[11], 10, 64)
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	return procStat{comm: s[open+1 : closing], ppid: ppid, ticks: utime + stime}, true
}

// cpuMeter measures client and server CPU over a phase.
type cpuMeter struct {
	server         *serverCPU
	client0        time.Duration
	srv0           map[int]int64
	serverMeasured bool
}

func startCPU(server *serverCPU) cpuMeter {
	m := cpuMeter{server: server, client0: processCPU()}
	m.srv0, m.serverMeasured = server.ticks()
	return m
}

// Stop returns the client's and the server's CPU over the phase; server is 0 when unknown.
func (m cpuMeter) Stop() (client, server time.Duration) {
	client = processCPU() - m.client0
	if now, ok := m.server.ticks(); ok && m.serverMeasured {
		server = since(m.srv0, now)
	}
	return client, server
}
