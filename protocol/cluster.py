"""The Redis Cluster client tokenbus makes (protocol.connection.redis_from_url): redis-py's RedisCluster whose
pipelines send the Lua scripts as EVALSHA instead of EVAL with their text.

redis-py refuses EVALSHA in a cluster pipeline because it could not load a script the shard lacks (NOSCRIPT).
Sending the text instead costs the shard about as much CPU again as the job's whole life otherwise
(docs/deployment.md, "Redis Cluster"). Here:

- before a script is queued, it is loaded (SCRIPT LOAD, once per node and script) on the node that owns its
  keys' slot, as the slot table names it now; a node not known to have it gets the text (EVAL) this once if
  the load fails (the node is down: the pipeline's own retry finds its successor);
- a failover puts the slot on another node (another address), which the table names after redis-py refreshes
  it on the error: the script is loaded there before the next pipeline uses it;
- NOSCRIPT can still come back: a node restarted at the same address without its scripts, or a command that
  redis-py re-sent on its own to a promoted replica after a connection error. NOSCRIPT means the script did not
  run, so that command is sent again, alone, as EVAL with the text (redis-py re-sends MOVED / failed commands
  alone in the same way), and a WAIT queued after it is asked again so it covers the write.

MULTI/EXEC pipelines keep EVAL: a NOSCRIPT inside EXEC would let the block's other commands through without the
script. A script call outside a pipeline goes as EVALSHA through redis-py's Script (NOSCRIPT handled there).
"""

from __future__ import annotations

from typing import Any

from redis.cluster import ClusterPipeline, RedisCluster
from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from protocol.connection import slot_owner

_TEXTS: dict[str, str] = {}  # sha -> script text, of every script queued as EVALSHA (a NOSCRIPT re-sends it)


class ScriptCluster(RedisCluster):
    """RedisCluster whose pipeline() gives a ScriptPipeline (scripts as EVALSHA)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # (node name "host:port", sha) of the scripts loaded on each node by this client; shared with its
        # pipelines. A stale entry (the node restarted) costs one NOSCRIPT, handled in ScriptPipeline.execute.
        self.scripts_loaded: set[tuple[str, str]] = set()

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        pipe = super().pipeline(transaction=transaction, shard_hint=shard_hint)
        # The subclass adds methods and two attributes, no constructor: swapping the class keeps working across
        # redis-py versions whose ClusterPipeline constructors take different arguments.
        pipe.__class__ = ScriptPipeline
        pipe.scripts_loaded = self.scripts_loaded
        pipe.transactional = bool(transaction)
        return pipe


class ScriptPipeline(ClusterPipeline):
    """A cluster pipeline that queues scripts as EVALSHA (queue_script) and re-sends a NOSCRIPT one as EVAL."""

    scripts_loaded: set[tuple[str, str]]
    transactional: bool

    def queue_script(self, text: str, sha: str, keys: list[Any], args: list[Any]) -> Any:
        """Queue one script call: EVALSHA where its node has it (loaded now if need be), EVAL otherwise."""
        if keys and not self.transactional:
            _TEXTS.setdefault(sha, text)
            if self._ensure_loaded(keys[0], text, sha):
                return self.execute_command("EVALSHA", sha, len(keys), *keys, *args)
        return self.execute_command("EVAL", text, len(keys), *keys, *args)

    def _ensure_loaded(self, key: Any, text: str, sha: str) -> bool:
        try:
            node = slot_owner(self, key)
            if (node.name, sha) not in self.scripts_loaded:
                self.get_redis_connection(node).script_load(text)
                self.scripts_loaded.add((node.name, sha))
        except (RedisError, RedisClusterException):  # node down or slot not covered: the text goes this once
            return False
        return True

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        queued = [(c.args, dict(c.options)) for c in _command_queue(self)]  # before execute() resets it
        replies = super().execute(raise_on_error=False)
        redo = [i for i, (args, _) in enumerate(queued) if str(args[0]).upper() == "EVALSHA"
                and isinstance(replies[i], NoScriptError) and str(args[1]) in _TEXTS]
        for i in redo:
            args, options = queued[i]
            sha = str(args[1])
            self.scripts_loaded.difference_update({x for x in self.scripts_loaded if x[1] == sha})
            replies[i] = self._alone("EVAL", _TEXTS[sha], *args[2:], **options)
        if redo:  # a WAIT queued after a re-sent script must count the replicas that have its write: ask the
            # node that ran it now (the slot's owner; the pool hands back the connection the EVAL just used)
            for i, (args, options) in enumerate(queued):
                if i > redo[0] and str(args[0]).upper() == "WAIT":
                    replies[i] = self._alone(*args, **self._at_owner(options, queued[redo[0]][0]))
        if raise_on_error:
            for i, reply in enumerate(replies):
                if isinstance(reply, Exception):
                    self.annotate_exception(reply, i + 1, queued[i][0] if i < len(queued) else ("?",))
                    raise reply
        return replies

    def _at_owner(self, options: dict[str, Any], evalsha: tuple[Any, ...]) -> dict[str, Any]:
        """`options` aimed at the node that owns the slot of an EVALSHA's first key, as the slot table says now
        (as they were if it names none)."""
        try:
            return {**options, "target_nodes": slot_owner(self, evalsha[3])}
        except (RedisError, RedisClusterException):
            return options

    def _alone(self, *args: Any, **options: Any) -> Any:
        """One command through the cluster client (its routing, redirections and retries), not the pipeline."""
        try:
            return self.parent_execute_command(*args, **options)
        except RedisError as err:
            return err


def _command_queue(pipe: ClusterPipeline) -> list[Any]:
    strategy = getattr(pipe, "_execution_strategy", None)  # redis-py >= 6; 5.x keeps command_stack itself
    return list(strategy.command_queue if strategy is not None else pipe.command_stack)
