"""The ways KV events travel to `KvEventClient`, one module per transport around one shared base.

- `kvroute._transports._base`: what every transport shares: the `Driver` / `Transport`
  interfaces, the driver base (`DriverBase`: the action loop, status, cursor, stop, lifecycle
  events, applying batches), the per-source counters and stats, the rate-limited log.
- `kvroute._transports.zmq`: the ZMQ transport (a SUB + replay DEALER per source), one module per concern;
- `kvroute._transports.gateway`: a gateway servicer's ``SubscribeKvEvents`` gRPC stream.

Importing the package imports nothing else, so every transport module can import the base.
"""
