package web

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"unicode"
	"unicode/utf8"
)

// PositionStore keeps a StreamClient's position in its stream: the ID of the last frame it
// handled, which it sends as Last-Event-ID when it connects.
type PositionStore interface {
	// Load returns the saved position, "" when nothing was handled yet.
	Load(ctx context.Context) (string, error)
	// Save replaces the saved position.
	Save(ctx context.Context, position string) error
}

// MaxStreamPosition bounds a saved position, in bytes. A stream ID is about 14 bytes per
// project (sse_id.go), so a stream of the handler's largest MaxProjects fits many times over.
const MaxStreamPosition = 64 << 10

// FilePositions keeps the position in the file at path. Save writes a temporary file in the
// same directory, syncs it, renames it over path and syncs the directory, so that after a
// crash the file holds the old position or the new one, whole. Load of a missing file is "".
// Both refuse a position longer than MaxStreamPosition or holding control characters or
// invalid UTF-8 (it is sent as an HTTP header).
func FilePositions(path string) PositionStore { return filePositions{path: path} }

type filePositions struct{ path string }

func (p filePositions) Load(context.Context) (string, error) {
	f, err := os.Open(p.path)
	if errors.Is(err, fs.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("load stream position: %w", err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, MaxStreamPosition+1))
	if err != nil {
		return "", fmt.Errorf("load stream position: %w", err)
	}
	pos := string(b)
	if err := checkStreamPosition(pos); err != nil {
		return "", fmt.Errorf("load stream position from %s: %w", p.path, err)
	}
	return pos, nil
}

func (p filePositions) Save(_ context.Context, position string) (err error) {
	if err := checkStreamPosition(position); err != nil {
		return fmt.Errorf("save stream position: %w", err)
	}
	dir, base := filepath.Split(p.path)
	if dir == "" {
		dir = "."
	}
	tmp, err := os.CreateTemp(dir, "."+base+".tmp-*")
	if err != nil {
		return fmt.Errorf("save stream position: %w", err)
	}
	defer func() {
		if err != nil {
			_ = tmp.Close()
			_ = os.Remove(tmp.Name())
		}
	}()
	if _, err = tmp.WriteString(position); err != nil {
		return fmt.Errorf("save stream position: %w", err)
	}
	if err = tmp.Sync(); err != nil {
		return fmt.Errorf("save stream position: %w", err)
	}
	if err = tmp.Close(); err != nil {
		return fmt.Errorf("save stream position: %w", err)
	}
	if err = os.Rename(tmp.Name(), p.path); err != nil {
		return fmt.Errorf("save stream position: %w", err)
	}
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("save stream position: sync directory: %w", err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("save stream position: sync directory: %w", err)
	}
	return nil
}

// checkStreamPosition refuses what cannot be a stream position; its errors never repeat it.
func checkStreamPosition(pos string) error {
	if len(pos) > MaxStreamPosition {
		return invalid("stream position", "is longer than %d bytes", MaxStreamPosition)
	}
	if !utf8.ValidString(pos) {
		return invalid("stream position", "is not valid UTF-8")
	}
	for _, r := range pos {
		if unicode.IsControl(r) {
			return invalid("stream position", "holds a control character")
		}
	}
	return nil
}
