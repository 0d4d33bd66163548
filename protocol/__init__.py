"""The contract every tokenbus process shares: wire models, key layout, priorities, error codes and the Lua.

Imports no torch: the client, the gateway and the worker all read it.
"""
