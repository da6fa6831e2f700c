-- The W3C trace context of the transaction that recorded an event, for hosts that trace.
--
-- The writer hook fills it only when the host configured a tracer provider: the traceparent of
-- the hook's own span, then, when there is one, a space and the tracestate. Consumers link the
-- span of every attempt to process the event to it. Nullable and last, with no default and no
-- index: adding it rewrites nothing, and a row without it costs nothing more than before. The
-- check bounds what a hostile writer can store (55 bytes of traceparent, 512 of tracestate).
ALTER TABLE lifecycle_outbox
    ADD COLUMN trace_context text
    CHECK (length(trace_context) <= 600 AND trace_context ~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}( |$)');
