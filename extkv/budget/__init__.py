"""extkv.budget: one KV budget shared by the engines of one device.

Theory of operation: an operator gives the KV caches of every engine on a
device one budget in bytes, and each engine asks before it creates physical
memory, so engines started together cannot both take what is free and run
the driver out. `ledger` is the arithmetic and the rules, pure and clock-free:
grants and tickets, leases that end with a connection and whose bytes count
until seen gone from outside, weighted max-min fair shares clipped to each
engine's floor, cap and demand, and reclaims asked only of engines above
their share. The protocol, the daemon that owns one ledger per device and
the client an engine passes to its cache are built on it; nothing in this
package imports torch or creates a CUDA context, so the daemon starts fast.
"""
