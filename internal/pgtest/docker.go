package pgtest

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/ory/dockertest/v3"
	"github.com/ory/dockertest/v3/docker"
)

// startDocker runs postgres:15 in a container when a Docker engine answers a ping. The docker
// client binary alone is not enough: the engine must respond.
func startDocker(ctx context.Context) (*server, error) {
	pool, err := dockertest.NewPool("")
	if err != nil {
		return nil, fmt.Errorf("no Docker client configuration: %w", err)
	}
	pingCtx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	if err := pool.Client.PingWithContext(pingCtx); err != nil {
		return nil, fmt.Errorf("no Docker engine answers: %w", err)
	}
	res, err := pool.RunWithOptions(&dockertest.RunOptions{
		Repository: "postgres",
		Tag:        "15",
		Env:        []string{"POSTGRES_PASSWORD=pgtest", "POSTGRES_USER=postgres", "POSTGRES_DB=postgres"},
		Cmd:        []string{"postgres", "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off", "-c", "max_connections=300"},
	}, func(hc *docker.HostConfig) {
		hc.AutoRemove = true
		hc.RestartPolicy = docker.RestartPolicy{Name: "no"}
	})
	if err != nil {
		return nil, fmt.Errorf("run postgres:15: %w", err)
	}
	_ = res.Expire(3600) // the engine removes it even if this process dies
	url := fmt.Sprintf("postgres://postgres:pgtest@%s/postgres?sslmode=disable", res.GetHostPort("5432/tcp"))
	pool.MaxWait = 2 * time.Minute
	if err := pool.Retry(func() error {
		c, err := pgx.Connect(ctx, url)
		if err != nil {
			return err
		}
		return c.Close(ctx)
	}); err != nil {
		_ = pool.Purge(res)
		return nil, errors.Join(errors.New("postgres:15 container never accepted connections"), err)
	}
	return &server{adminURL: url, kind: "docker", close: func() { _ = pool.Purge(res) }}, nil
}
