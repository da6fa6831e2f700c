package testhost

import (
	"context"
	"sort"
	"sync"
	"time"
)

// Cache is the store's in-memory set of live task IDs per project. It implements
// outbox.TaskCache: removals are idempotent and report whether anything changed.
type Cache struct {
	mu    sync.RWMutex
	live  map[string]map[string]struct{}
	hooks []func(projectID, taskID string, removed bool)
}

// NewCache returns an empty cache.
func NewCache() *Cache { return &Cache{live: map[string]map[string]struct{}{}} }

// OnRemove registers fn to hear every observed removal attempt (removed=false for a
// re-delivery that found the task already gone). Tests and the fault suite keep their
// application logs with it.
func (c *Cache) OnRemove(fn func(projectID, taskID string, removed bool)) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.hooks = append(c.hooks, fn)
}

func (c *Cache) add(projectID, taskID string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	set := c.live[projectID]
	if set == nil {
		set = map[string]struct{}{}
		c.live[projectID] = set
	}
	set[taskID] = struct{}{}
}

func (c *Cache) remove(projectID, taskID string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	set := c.live[projectID]
	if _, ok := set[taskID]; !ok {
		return false
	}
	delete(set, taskID)
	return true
}

// RemoveTask implements outbox.TaskCache.
func (c *Cache) RemoveTask(_ context.Context, projectID, taskID string, _ time.Time) (bool, error) {
	removed := c.remove(projectID, taskID)
	c.mu.RLock()
	hooks := c.hooks
	c.mu.RUnlock()
	for _, h := range hooks {
		h(projectID, taskID, removed)
	}
	return removed, nil
}

// ReplaceLive implements outbox.TaskCache.
func (c *Cache) ReplaceLive(_ context.Context, projectID string, ids []string) error {
	set := make(map[string]struct{}, len(ids))
	for _, id := range ids {
		set[id] = struct{}{}
	}
	c.mu.Lock()
	c.live[projectID] = set
	c.mu.Unlock()
	return nil
}

// Has reports whether a task is cached as live.
func (c *Cache) Has(projectID, taskID string) bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	_, ok := c.live[projectID][taskID]
	return ok
}

// Live returns the cached live IDs of a project, sorted.
func (c *Cache) Live(projectID string) []string {
	c.mu.RLock()
	defer c.mu.RUnlock()
	out := make([]string, 0, len(c.live[projectID]))
	for id := range c.live[projectID] {
		out = append(out, id)
	}
	sort.Strings(out)
	return out
}
