// Package testhost is the fixture the module's tests, benchmarks, demo and fault suite run
// against: the reference host of example/taskstore, used through its public API exactly as a
// real host would use it, and the observer process the demo and the fault suite share
// (observer.go). What the tests need beyond the reference host belongs here, so that the
// example stays a host a reader can copy, shaped by nothing but the module's public API.
package testhost

import "fusion/outbox/example/taskstore"

// The reference host's types and constructors, under the fixture's name.
type (
	Cache        = taskstore.Cache
	DeleteResult = taskstore.DeleteResult
	Emitter      = taskstore.Emitter
	HostConfig   = taskstore.HostConfig
	Options      = taskstore.Options
	SelfHealing  = taskstore.SelfHealing
	Settings     = taskstore.Settings
	Store        = taskstore.Store
	SweepResult  = taskstore.SweepResult
	Task         = taskstore.Task
	TaskDeleted  = taskstore.TaskDeleted
)

var (
	// New is taskstore.New.
	New = taskstore.New
	// NewBusBridge is taskstore.NewBusBridge.
	NewBusBridge = taskstore.NewBusBridge
	// NewCache is taskstore.NewCache.
	NewCache = taskstore.NewCache
	// NewSelfHealing is taskstore.NewSelfHealing.
	NewSelfHealing = taskstore.NewSelfHealing
	// NewSettings is taskstore.NewSettings.
	NewSettings = taskstore.NewSettings
	// ErrTaskNotFound is taskstore.ErrTaskNotFound.
	ErrTaskNotFound = taskstore.ErrTaskNotFound
	// Module is taskstore.Module.
	Module = taskstore.Module
)
