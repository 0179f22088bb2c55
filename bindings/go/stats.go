package smartgen

import "github.com/smartgen/smartgen/bindings/go/internal/raw"

// ContextStats mirror sg_context_stats_t: counters since the context was made, monotonic except
// the gauges SessionsOpen, Registrations and Lanes.
type ContextStats struct {
	BytesDirect, BytesStaged, RMAOps, StagingCopies             uint64
	MessagesSent, MessagesReceived, Retries                     uint64
	TransfersCompleted, TransfersFailed, TransfersCanceled      uint64
	DeadlinesHit, PeersLost, SessionsOpen, AuthFailures, Stalls uint64
	Registrations, Lanes, LaneFailovers, LanesLost              uint64
	// End-to-end verification (SG_TRANSFER_VERIFY=1): blocks checked on arrival, and mismatches.
	BlocksVerified, VerifyMismatches uint64
}

// Stats is a snapshot of the context's counters (sg_context_stats).
func (c *Context) Stats() (ContextStats, error) {
	o := raw.Sgo_context_stats_new()
	if o.Swigcptr() == 0 {
		return ContextStats{}, newError("sg_context_stats", StatusNoMemory, "cannot allocate the stats")
	}
	defer raw.DeleteSg_context_stats_t(o)
	err := c.call("sg_context_stats", func(e raw.Sg_error_info_t) int32 {
		return raw.Sgo_sg_context_stats(c.h, o, e)
	})
	if err != nil {
		return ContextStats{}, err
	}
	return ContextStats{
		BytesDirect: o.GetBytes_direct(), BytesStaged: o.GetBytes_staged(), RMAOps: o.GetRma_ops(),
		StagingCopies: o.GetStaging_copies(), MessagesSent: o.GetMessages_sent(),
		MessagesReceived: o.GetMessages_received(), Retries: o.GetRetries(),
		TransfersCompleted: o.GetTransfers_completed(), TransfersFailed: o.GetTransfers_failed(),
		TransfersCanceled: o.GetTransfers_canceled(), DeadlinesHit: o.GetDeadlines_hit(),
		PeersLost: o.GetPeers_lost(), SessionsOpen: o.GetSessions_open(), AuthFailures: o.GetAuth_failures(),
		Stalls: o.GetStalls(), Registrations: o.GetRegistrations(), Lanes: o.GetLanes(),
		LaneFailovers: o.GetLane_failovers(), LanesLost: o.GetLanes_lost(),
		BlocksVerified: o.GetBlocks_verified(), VerifyMismatches: o.GetVerify_mismatches(),
	}, nil
}
