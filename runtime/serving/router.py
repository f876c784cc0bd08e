"""Prefix-aware routing of requests to Engine replicas, written against Ray Serve's request-router API
(`request_router_config` of a deployment; `ray.serve.request_router`).

Each replica has its own prefix cache, so a chat's next turn finds its last prompt and answer only on the replica
that served the last turn. `PrefixRouter` remembers, per replica, the prefixes of the requests routed there, and
sends a request to the replica holding the longest of them, if that replica has room (fewer ongoing requests than its
batch); else, or with no prefix known, to the less loaded of two replicas picked at random, as Serve's default router
(power of two choices).

A prefix is a chain of pieces, each hashed with the one before (`prefix_pieces`): for chat, one piece a message
(so turn t + 1, which repeats turn t's messages and adds the answer and a new user message, matches all of turn t's
messages); for completions, 64-character blocks of the prompt's text (or 16-id blocks of its ids). The chain starts
from the request's prefix-cache partition (its API key and `cache_salt`): only a replica that holds the same
partition's blocks can serve a hit. The router reads the handle call's body for it (JSON, at each routing attempt and
once more when the request is routed): about 4 ms for a 200 KB chat here, on the ingress's routing loop.

Ray Serve LLM's `PrefixCacheAffinityRouter` does not fit the ingress: it reads a `prompt` or `messages` attribute of
the handle call's arguments (ours are the HTTP request's method, path, headers and body) and raises where there is
none (GET /v1/models), divides by zero on an empty prompt, and keeps its tree in another actor that it asks with a
blocking `ray.get` from the router's event loop, twice a request.

This module is sent to the replicas' handles by value (Serve cloudpickles a router's module): it imports only the
standard library and Ray.
"""
from __future__ import annotations

import hashlib
import json
import random
from collections import OrderedDict

from ray.serve.request_router import (LocalityMixin, MultiplexMixin, PendingRequest, ReplicaID, RequestRouter,
                                      RunningReplica)

CHARS = 64              # a piece of a completion prompt's text
IDS = 16                # a piece of a completion prompt's token ids
ENTRIES = 200_000       # pieces remembered per replica (least recently routed out first): ~20 MB
ROUTED = ("/v1/chat/completions", "/v1/completions")


def prefix_pieces(path: str, headers: list, body: bytes) -> list[bytes]:
    """The hash chain of a request's prompt (a chat's messages, a completion's prompt), from its partition; [] for a
    request that has none (another path, a body that is not a JSON object: the replica answers it as it must)."""
    if path not in ROUTED:
        return []
    try:
        doc = json.loads(body)
    except ValueError:
        return []
    if not isinstance(doc, dict):
        return []
    prompt = doc.get("messages" if path == ROUTED[0] else "prompt")
    if path == ROUTED[0] and isinstance(prompt, list):
        pieces = [json.dumps(m, sort_keys=True, separators=(",", ":")) for m in prompt]
    elif isinstance(prompt, str):
        pieces = [prompt[i:i + CHARS] for i in range(0, len(prompt) - CHARS + 1, CHARS)]
    elif isinstance(prompt, list) and all(isinstance(i, int) for i in prompt):
        pieces = [" ".join(map(str, prompt[i:i + IDS])) for i in range(0, len(prompt) - IDS + 1, IDS)]
    else:
        return []
    key = dict(headers).get("authorization", "")
    chain = [hashlib.blake2b(json.dumps([key, doc.get("cache_salt")]).encode(), digest_size=16).digest()]
    for piece in pieces:
        chain.append(hashlib.blake2b(chain[-1] + piece.encode(), digest_size=16).digest())
    return chain[1:]


class PrefixRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Ranks first the replicas holding the longest known prefix of the request, then two at random (Serve takes,
    within a rank, the replica with the fewest ongoing requests that has room). No FIFO mixin: a replica chosen for a
    request goes to that request."""

    def initialize_state(self, entries: int = ENTRIES):
        self.entries = entries
        self.held: dict[ReplicaID, OrderedDict] = {}   # replica -> the pieces routed there, least recent first

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ids = self.apply_locality_routing(pending_request)
        replicas = [r for r in candidate_replicas if r.replica_id in ids]
        if not replicas:
            return []
        ranks = [random.sample(replicas, min(2, len(replicas)))]
        chain = self._chain(pending_request)
        depth = {r.replica_id: _depth(chain, self.held.get(r.replica_id, {})) for r in replicas}
        best = max(depth.values())
        if best > 0:
            ranks.insert(0, [r for r in replicas if depth[r.replica_id] == best])
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        held = self.held.setdefault(replica_id, OrderedDict())
        for piece in reversed(self._chain(pending_request)):   # the first piece last: it leaves after its children
            held[piece] = None
            held.move_to_end(piece)
        while len(held) > self.entries:
            held.popitem(last=False)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.held = {r: held for r, held in self.held.items() if r in self._replica_id_set}

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.held.pop(replica_id, None)

    @staticmethod
    def _chain(pending_request: PendingRequest | None) -> list[bytes]:
        """The prefix of Ingress.forward's call (method, path, query, headers, body)."""
        if pending_request is None or len(pending_request.args) != 5:
            return []
        _, path, _, headers, body = pending_request.args
        return prefix_pieces(path, headers, body)


def _depth(chain: list[bytes], held) -> int:
    """How many leading pieces of `chain` a replica holds."""
    depth = 0
    while depth < len(chain) and chain[depth] in held:
        depth += 1
    return depth
