package smartgen

import (
	"context"
	"sync"
	"testing"
	"time"
)

// The handler goroutine calls back into the binding (LayerState, Status, Stats on the transfer
// the event names) while the progress thread keeps delivering events.
func TestEventsWithAHandlerThatCallsBack(t *testing.T) {
	p := newPair(t, testKey(t), ContextOptions{EventBuffer: 64})
	fillBlocks(p.prefillPool, prefillTable, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	var mu sync.Mutex
	ready := map[uint32]LayerState{}
	var finished []Status
	var handlerErr error
	handled := make(chan struct{})
	go func() {
		defer close(handled)
		for ev := range p.decode.Events() {
			x := ev.Transfer()
			if x == nil || ev.RequestID != "events" {
				continue
			}
			mu.Lock()
			switch ev.Kind {
			case EventLayerReady:
				state, err := x.LayerState(ev.Layer)
				if err != nil && handlerErr == nil {
					handlerErr = err
				}
				ready[ev.Layer] = state
			case EventFinished:
				st, _, err := x.Status()
				if err != nil && handlerErr == nil {
					handlerErr = err
				}
				if _, err := x.Stats(); err != nil && handlerErr == nil {
					handlerErr = err
				}
				finished = append(finished, st, ev.Status)
			}
			mu.Unlock()
		}
	}()

	dst, err := p.decodeSess.Expect("events", p.decodeKV, decodeTable, 7*16, TransferOptions{})
	if err != nil {
		t.Fatal(err)
	}
	src, err := p.prefillSession.Post("events", p.prefillKV, prefillTable, 7*16,
		TransferOptions{Flags: AllLayersWritten})
	if err != nil {
		t.Fatal(err)
	}
	if err := dst.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := src.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if bad := checkBlocks(p.decodePool, decodeTable, 3); bad != "" {
		t.Fatal(bad)
	}
	// FINISHED comes after the wait can return: give the handler a moment to see it.
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		mu.Lock()
		n := len(finished)
		mu.Unlock()
		if n > 0 {
			break
		}
	}
	if err := dst.Release(); err != nil {
		t.Fatal(err)
	}
	if err := src.Release(); err != nil {
		t.Fatal(err)
	}
	if err := p.decode.Close(); err != nil { // closes the channel: the handler ends
		t.Fatal(err)
	}
	<-handled

	mu.Lock()
	defer mu.Unlock()
	if handlerErr != nil {
		t.Fatalf("a call from the handler failed: %v", handlerErr)
	}
	for l := uint32(0); l < testLayout.NumLayers; l++ {
		if ready[l]&StateReady == 0 {
			t.Errorf("layer %d: LayerState from the handler %#x, ready events %v", l, ready[l], ready)
		}
	}
	if len(finished) != 2 || finished[0] != StatusOK || finished[1] != StatusOK {
		t.Errorf("finished: transfer status and event status %v", finished)
	}
	if n := p.decode.DroppedEvents(); n != 0 {
		t.Errorf("%d events dropped with a 64-event buffer", n)
	}
}

// Nobody reads the channel: the progress thread drops what does not fit and the transfer goes on.
func TestAFullEventChannelDoesNotStopTransfers(t *testing.T) {
	p := newPair(t, testKey(t), ContextOptions{EventBuffer: 1})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	dst, err := p.decodeSess.Expect("unread", p.decodeKV, decodeTable, 7*16, TransferOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := dst.Close(); err != nil {
			t.Errorf("decode release: %v", err)
		}
	}()
	src, err := p.prefillSession.Post("unread", p.prefillKV, prefillTable, 7*16,
		TransferOptions{Flags: AllLayersWritten})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := src.Close(); err != nil {
			t.Errorf("prefill release: %v", err)
		}
	}()
	if err := dst.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := src.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	// The events of a transfer may still be on their way when its wait returns.
	for deadline := time.Now().Add(5 * time.Second); p.decode.DroppedEvents() == 0 && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	if p.decode.DroppedEvents() == 0 {
		t.Fatal("no event dropped with a 1-event buffer nobody reads")
	}
	if ev := <-p.decode.Events(); ev.Kind != EventLayerReady || ev.RequestID != "unread" {
		t.Fatalf("the event kept: %+v", ev)
	}
}

// Every event of a transfer is in the Events channel when its Wait returns, so a host that
// releases right after Wait (the README's pattern) misses none: 0.4 delivered LAYER_READY, FINISHED
// and QUIESCED 1.1-1.5 ms after Wait returned.
func TestEveryEventIsInTheChannelWhenWaitReturns(t *testing.T) {
	p := newPair(t, testKey(t), ContextOptions{EventBuffer: 256})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for i := 0; i < 20; i++ {
		rid := "drain-" + string(rune('a'+i))
		dst, err := p.decodeSess.Expect(rid, p.decodeKV, decodeTable, 7*16, TransferOptions{})
		if err != nil {
			t.Fatal(err)
		}
		src, err := p.prefillSession.Post(rid, p.prefillKV, prefillTable, 7*16, TransferOptions{Flags: AllLayersWritten})
		if err != nil {
			t.Fatal(err)
		}
		if err := dst.Wait(ctx); err != nil {
			t.Fatal(err)
		}
		if err := dst.WaitQuiesced(ctx); err != nil {
			t.Fatal(err)
		}
		// Released at once, then the channel read without waiting.
		if err := dst.Release(); err != nil {
			t.Fatal(err)
		}
		counts := map[EventKind]int{}
	drain:
		for {
			select {
			case ev := <-p.decode.Events():
				if ev.RequestID == rid {
					counts[ev.Kind]++
				}
			default:
				break drain
			}
		}
		if counts[EventLayerReady] != int(testLayout.NumLayers) || counts[EventFinished] != 1 || counts[EventQuiesced] != 1 {
			t.Fatalf("%s: events in the channel when Wait returned: %v (want %d LAYER_READY, 1 FINISHED, 1 QUIESCED)",
				rid, counts, testLayout.NumLayers)
		}
		if err := src.Wait(ctx); err != nil {
			t.Fatal(err)
		}
		if err := src.Release(); err != nil {
			t.Fatalf("%s: prefill release: %v", rid, err)
		}
	}
}
