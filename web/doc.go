// Package web is the web surface of fusion/outbox: the event stream that browsers, child
// workers and remote nodes follow, the client with which a process follows it, and the
// operations page. It is built on the core package's public API alone (the core does not
// import it), so a host that wants none of it links none of it.
//
// # The event stream
//
// SSEHandler serves the process's observed task deletions as Server-Sent Events. It is one of
// the observed listeners of the process's durable consumer (outbox.Listener, and
// outbox.OwnWritesListener so that the process's own deletions reach it in sequence order with
// everyone else's, and outbox.ParkedListener so that a dead letter reaches the clients in its
// place and moves them past it); the clients are ephemeral and own no cursor. Every event a client is sent
// carries an ID holding the client's position in every project of its stream (sse_id.go), which
// a browser's EventSource sends back as Last-Event-ID when it reconnects: the handler then
// sends what the client missed, from its ring of recent events per project or, further back,
// from the retained outbox, and continues live, with no duplicate and no gap. A client it
// cannot resume (further behind than MaxReplay, behind the pruned floor, past its budget of
// outbox reads, or with an ID that is not this stream's) gets a reset naming the projects to
// refetch and the reason (SSEReset), and continues from their newest events. A slow client
// never holds up the consumer. The ID depends on nothing but the stream's project list, so a
// client may reconnect to another process serving the same stream.
//
// # Following a stream
//
// StreamClient follows an SSEHandler's stream from another process: a child worker fed by its
// parent over a unix socket only the parent's user can open (ListenUnix, UnixSocketClient), or
// a remote node following an engine over HTTP. It keeps its position in a PositionStore
// (FilePositions), so that across reconnects and restarts its StreamHandler gets every event
// once, in order, in a context marked observed, or a reset where the stream cannot tell what it
// missed. The server and the client share one framing (StreamFrame, StreamReader; see
// stream_frame.go) and one resume logic.
//
// # The operations page
//
// OpsHandler serves, over an *outbox.Admin, what an on-call engineer wants to see: a summary of
// what needs attention, the worst first, with why and what to do and a link to the runbook;
// every consumer's lag, lease and deliveries; the dead letters; and a live feed of the event
// stream. With OpsOptions.AuthorizeAction it also offers audited replay and retire buttons,
// guarded by same-origin checks and a form token bound to a cookie.
//
// # Wiring
//
// Neither the stream nor the page authenticates anyone: the host mounts both behind its own
// authentication and gives both the same per-project hook (SSEOptions.Authorize,
// OpsOptions.Authorize). The host builds the stream on its consumer's pool and projects and
// registers it as an observed listener, with fx for example
//
//	fx.Provide(
//		newSSE, // func(...) (*web.SSEHandler, error): web.NewSSEHandler(web.SSEOptions{Pool: pool, Projects: projects, ...})
//		outbox.AsListener(func(h *web.SSEHandler) *web.SSEHandler { return h }),
//	)
//
// (without fx, put it in outbox.Deps.Listeners), and serves it beside the page:
//
//	mux.Handle("/events", sse)
//	mux.Handle("/ops/", http.StripPrefix("/ops", ops))
//
// with the server's shutdown ending the streams (RegisterOnShutdown(sse.Close)). The reference
// host in example/taskstore does all of this, and serves the stream to its child workers on a
// unix socket (HostConfig.ChildSocket).
package web
