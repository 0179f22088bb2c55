// The C function the library calls for each transfer event (sg_context_options_t.event_fn). It
// only forwards to the exported Go function; event_user is a runtime/cgo Handle value.
#include <stdint.h>

#include <smartgen/smartgen.h>

#include "_cgo_export.h"

void smartgen_go_event_trampoline(void *user, const sg_event_t *event)
{
    smartgenGoEvent((uintptr_t)user, (sg_event_t *)event);
}
