package smartgen

import "github.com/smartgen/smartgen/bindings/go/internal/raw"

// LibraryVersion is "MAJOR.MINOR.PATCH" of the libsmartgen loaded (sg_version_string).
func LibraryVersion() string { return raw.Sg_version_string() }
