"""The ZMQ transport: a SUB per source for live batches, a DEALER for replay, one receive loop per client.

One module per concern, in the order a batch meets them:

- `kvroute._transports.zmq.transport`: `ZmqTransport`, what the client asks (which sources, why one is
  refused, a driver for one); it holds the client's receivers and replay slots.
- `kvroute._transports.zmq.config`: `SubscriberConfig`, every socket option, bound and budget.
- `kvroute._transports.zmq.receiver`: `Receiver`, the Python receive loop over every source's SUB and
  monitor (one OS selector), and the session leadership both receive loops share.
- `kvroute._transports.zmq.native`: `NativeReceiver`, the receive loop on the compiled core's thread.
- `kvroute._transports.zmq.driver`: `SourceDriver`, one source's SUB session, its monitor events, and the
  recovery machine's actions carried out.
- `kvroute._transports.zmq.payloads`: one payload decoded and checked, or applied in place (the fast path).
- `kvroute._transports.zmq.replay`: `ReplayRequester`, one source's replay requests (a DEALER each),
  carried out in turns of the `ReplaySlots` a client's sources share.
- `kvroute._transports.zmq.sockets`: the one anyio seam over pyzmq (waiting, socket setup, monitors,
  CURVE, the file-descriptor budget).

Importing the package imports nothing else.
"""
