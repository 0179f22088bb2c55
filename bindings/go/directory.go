package smartgen

import (
	"context"
	"errors"
	"time"

	"github.com/smartgen/smartgen/bindings/go/internal/raw"
)

// DirectoryOptions mirror sg_directory_options_t; zero values are the library's defaults.
type DirectoryOptions struct {
	Endpoints      string        // "http://10.0.0.1:2379,http://10.0.0.2:2379" (required)
	Prefix         string        // "" = "/smartgen/"
	LeaseTTL       time.Duration // 0 = 5 s; whole seconds
	RequestTimeout time.Duration // one request to one member; 0 = 1 s
}

// Directory is a handle on the cluster directory (sg_directory_t, docs/directory.md): engines
// publish themselves under a name and open sessions to each other by name. Closing the context
// closes it too, withdrawing its names.
type Directory struct {
	c    *Context
	h    uintptr
	life lifecycle
}

// OpenDirectory opens the directory for this context; a member must answer.
func (c *Context) OpenDirectory(opts DirectoryOptions) (*Directory, error) {
	var h uintptr
	err := c.call("sg_directory_open", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_directory_open(c.h, opts.Endpoints, opts.Prefix, uint32(opts.LeaseTTL/time.Millisecond),
			uint32(opts.RequestTimeout/time.Millisecond), &h, e)
	})
	if err != nil {
		return nil, err
	}
	return &Directory{c: c, h: h}, nil
}

// timeoutOf is the time left before ctx's deadline (10 s when it has none), for the directory's
// calls, which take one timeout and are not repeated in slices (a connect leaves a request).
func timeoutOf(ctx context.Context) uint64 {
	if d, ok := ctx.Deadline(); ok {
		if left := time.Until(d); left > 0 {
			return uint64(left)
		}
		return 0
	}
	return uint64(10 * time.Second)
}

// Publish puts this context's signed metadata under name; SG_ERR_AUTH_FAILED when another key's
// engine holds the name.
func (d *Directory) Publish(ctx context.Context, name string) error {
	return d.life.call(d.c, "sg_directory_publish", "directory", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_directory_publish(d.h, name, timeoutOf(ctx), e)
	})
}

// Unpublish removes a name this handle published.
func (d *Directory) Unpublish(ctx context.Context, name string) error {
	return d.life.call(d.c, "sg_directory_unpublish", "directory", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_directory_unpublish(d.h, name, timeoutOf(ctx), e)
	})
}

// Lookup is the metadata blob published under name (StatusNotFound when none).
func (d *Directory) Lookup(ctx context.Context, name string) ([]byte, error) {
	for {
		var n uint64
		err := d.life.call(d.c, "sg_directory_lookup", "directory", func(e raw.Sg_error_info_t) int32 {
			return raw.Sgo_directory_lookup(d.h, name, timeoutOf(ctx), nil, 0, &n, e)
		})
		if err != nil {
			return nil, err
		}
		blob := make([]byte, n+1)
		err = d.life.call(d.c, "sg_directory_lookup", "directory", func(e raw.Sg_error_info_t) int32 {
			return raw.Sgo_directory_lookup(d.h, name, timeoutOf(ctx), &blob[0], uint64(len(blob)), &n, e)
		})
		if !errors.Is(err, StatusBufferTooSmall) { // republished larger between the two calls
			return blob[:n], err
		}
	}
}

// List is the names published under prefix ("" for all), sorted.
func (d *Directory) List(ctx context.Context, prefix string) ([]string, error) {
	for {
		var n, count uint64
		err := d.life.call(d.c, "sg_directory_list", "directory", func(e raw.Sg_error_info_t) int32 {
			return raw.Sgo_directory_list(d.h, prefix, timeoutOf(ctx), nil, 0, &n, &count, e)
		})
		if err != nil {
			return nil, err
		}
		if n == 0 {
			return []string{}, nil
		}
		buf := make([]byte, n)
		err = d.life.call(d.c, "sg_directory_list", "directory", func(e raw.Sg_error_info_t) int32 {
			return raw.Sgo_directory_list(d.h, prefix, timeoutOf(ctx), &buf[0], uint64(len(buf)), &n, &count, e)
		})
		if errors.Is(err, StatusBufferTooSmall) { // a name was published between the two calls
			continue
		}
		if err != nil {
			return nil, err
		}
		names := make([]string, 0, count)
		for start, i := 0, 0; i < int(n); i++ {
			if buf[i] == 0 {
				names = append(names, string(buf[start:i]))
				start = i + 1
			}
		}
		return names, nil
	}
}

// Wait returns once name is published (present) or gone (!present), watching the cluster;
// StatusTimeout when ctx's deadline comes first.
func (d *Directory) Wait(ctx context.Context, name string, present bool) error {
	p := int32(0)
	if present {
		p = 1
	}
	return d.life.call(d.c, "sg_directory_wait", "directory", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_directory_wait(d.h, name, p, timeoutOf(ctx), e)
	})
}

// DirectoryStats mirror sg_directory_stats_t.
type DirectoryStats struct {
	Requests, Failovers, Keepalives, LeasesGranted, SessionsAccepted, RequestsRefused uint64
	NamesTakenOver, NamesRestored                                                     uint64
}

// Stats is a snapshot of the handle's counters.
func (d *Directory) Stats() (DirectoryStats, error) {
	var c [8]uint64
	err := d.life.call(d.c, "sg_directory_stats", "directory", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_directory_stats(d.h, &c[0], e)
	})
	return DirectoryStats{c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]}, err
}

// Connect opens a session to the engine published as name (its entry must verify under this
// context's key).
func (d *Directory) Connect(ctx context.Context, name string) (*Session, error) {
	var h uintptr
	err := d.life.call(d.c, "sg_directory_connect", "directory", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_directory_connect(d.h, name, timeoutOf(ctx), &h, e)
	})
	if err != nil {
		return nil, err
	}
	return &Session{c: d.c, h: h}, nil
}

// Accept is the next session an engine opened to one of this handle's names.
func (d *Directory) Accept(ctx context.Context) (*Session, error) {
	var h uintptr
	err := d.life.call(d.c, "sg_directory_accept", "directory", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_directory_accept(d.h, timeoutOf(ctx), &h, e)
	})
	if err != nil {
		return nil, err
	}
	return &Session{c: d.c, h: h}, nil
}

// Close destroys the handle, withdrawing its names at once. Safe to call more than once.
func (d *Directory) Close() error {
	if d == nil {
		return nil
	}
	return d.life.close(d.c, "sg_directory_destroy", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_directory_destroy(d.h, e)
	})
}
