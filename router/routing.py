"""Where a request goes: the router's routing policies and its estimate of what each worker holds in its prefix
cache.

`--routing-policy` (router and `tandem serve`):
- `cache_aware` (the default; SGLang's policy of that name, over token blocks): a request goes to the worker with
  the longest expected prefix-cache hit, unless that hit is under `--cache-threshold` of the prompt, or the worker
  is overloaded: its load exceeds the least-loaded worker's by more than `--balance-abs-threshold` tokens and
  `--balance-rel-threshold` times. Then it goes by load, as under `least_loaded`. A prefill worker's load is its
  queued prompt tokens (the router's own in flight there included), a decode worker's its KV tokens in use.
- `least_loaded`: by load alone (WorkerPool.candidates' order).
- `round_robin`: the healthy workers in turn, one turn per request.

The estimate (`PrefixIndex`) is learned from what the router sent where: a worker holds the block keys of the
prompts it was given (a decode worker also of prompt + answer, a conversation's next turn's prefix), least recently
used first out, at most as many blocks as its KV cache holds, each forgotten after `MAX_AGE_SECONDS`. The keys are
the router's own (`BLOCK_SIZE`-token blocks, `tandem/cache/prefix.py`'s chained hash, its own seed): an estimate
needs no agreement with the workers' keys. A worker that goes unhealthy or away is forgotten (a restarted worker
starts with an empty cache).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count

from tandem.cache.prefix import block_keys, chain_seed

POLICIES = ("cache_aware", "least_loaded", "round_robin")
BLOCK_SIZE = 16  # the estimate's granularity (the workers' default block size)
SEED = chain_seed("tandem-router")
MAX_AGE_SECONDS = 600.0  # an entry the router has not refreshed in this long is taken to be evicted
DEFAULT_CAPACITY = 1 << 16  # blocks per worker while its KV cache size is not known yet (no poll answered)


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "cache_aware"
    cache_threshold: float = 0.3  # SGLang's defaults (sgl-router, cache_aware)
    balance_abs_threshold: int = 4096  # tokens (SGLang's counts requests: 64); about one long prompt's prefill
    balance_rel_threshold: float = 1.5

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy {self.policy!r} is not one of {POLICIES}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance thresholds: absolute >= 0 tokens, relative >= 1")

    @classmethod
    def from_args(cls, args) -> "RoutingConfig":
        return cls(args.routing_policy, args.cache_threshold, args.balance_abs_threshold,
                   args.balance_rel_threshold)


def add_routing_args(ap) -> None:
    d = RoutingConfig()
    ap.add_argument("--routing-policy", choices=POLICIES, default=d.policy,
                    help="where requests go: the worker with the longest expected prefix-cache hit unless it is "
                    "overloaded (cache_aware), the least loaded, or in turn")
    ap.add_argument("--cache-threshold", type=float, default=d.cache_threshold,
                    help="cache_aware: the smallest expected hit, as a share of the prompt, that places a request "
                    "by cache rather than by load")
    ap.add_argument("--balance-abs-threshold", type=int, default=d.balance_abs_threshold,
                    help="cache_aware: a worker whose load (tokens) exceeds the least-loaded one's by more than this "
                    "and --balance-rel-threshold times is passed over")
    ap.add_argument("--balance-rel-threshold", type=float, default=d.balance_rel_threshold,
                    help="cache_aware: see --balance-abs-threshold")


def routing_argv(args) -> list[str]:
    """The routing flags of `args`, as argv, for a launcher passing them on to the router."""
    return ["--routing-policy", args.routing_policy, "--cache-threshold", str(args.cache_threshold),
            "--balance-abs-threshold", str(args.balance_abs_threshold),
            "--balance-rel-threshold", str(args.balance_rel_threshold)]


@dataclass
class Route:
    """One request's routing: its prompt, the prompt's block keys (computed on first use, once), its round-robin
    turn per pool, and each pool's first choice for it with the reason (a `tandem.metrics.ROUTES` value)."""

    tokens: list[int]
    turns: dict[str, int] = field(default_factory=dict)
    picks: dict[str, tuple[str, str]] = field(default_factory=dict)  # role -> (address, reason)
    _keys: list[int] | None = None

    def reason(self, role: str, address: str) -> str:
        """Why the request went to `address`: its pool's reason when that was its first choice, else by load (the
        first choice refused it)."""
        first, why = self.picks.get(role, ("", "least_loaded"))
        return why if first == address else "least_loaded"

    @property
    def keys(self) -> list[int]:
        if self._keys is None:
            self._keys = block_keys(self.tokens, BLOCK_SIZE, False, SEED, [])
        return self._keys

    def keys_of(self, tokens: list[int]) -> list[int]:
        """The block keys of `tokens`, which start with the prompt (e.g. prompt + answer)."""
        keys = list(self.keys)
        return block_keys(tokens[len(keys) * BLOCK_SIZE:], BLOCK_SIZE, False, SEED, keys)


class PrefixIndex:
    """Per worker, the block keys the router sent there with when it last did, least recently used first."""

    def __init__(self, max_age: float = MAX_AGE_SECONDS):
        self.max_age = max_age
        self._held: dict[str, OrderedDict[int, float]] = {}

    def add(self, worker: str, keys: list[int], now: float, capacity: int) -> None:
        """Keys added last first: a prefix stays more recent than its continuations (the workers free a request's
        blocks tail first, so their caches keep prefixes longest too)."""
        held = self._held.setdefault(worker, OrderedDict())
        for k in reversed(keys):
            held[k] = now
            held.move_to_end(k)
        while len(held) > max(capacity, 1):
            held.popitem(last=False)

    def match(self, worker: str, keys: list[int], now: float) -> int:
        """How many of `keys`, from the first, `worker` holds (none older than max_age)."""
        held, n = self._held.get(worker), 0
        if held:
            for k in keys:
                t = held.get(k)
                if t is None or now - t > self.max_age:
                    break
                n += 1
        return n

    def forget(self, worker: str) -> None:
        self._held.pop(worker, None)

    def size(self, worker: str) -> int:
        return len(self._held.get(worker, ()))


class RoutingPolicy:
    """One worker pool's placement: the order its candidate workers are tried in for a request, and what it learns
    from where requests went."""

    def __init__(self, cfg: RoutingConfig, role: str):
        self.cfg, self.role = cfg, role
        self.index = PrefixIndex()
        self._lock = threading.Lock()
        self._turns = count()

    def order(self, ranked: list, load: Callable, route: Route | None, fits: Callable = lambda w: True) -> list:
        """`ranked`: the healthy workers by load, least first (WorkerPool.candidates); `load(w)` in tokens;
        `fits(w)`: whether `w` has room for the request now (a worker without is not preferred for its cache).
        Records the first choice and why in `route.picks[role]`."""
        if route is None or not ranked:
            return ranked
        if self.cfg.policy == "round_robin":
            turn = route.turns.setdefault(self.role, next(self._turns))
            ws = sorted(ranked, key=lambda w: w.address)
            i = turn % len(ws)
            route.picks[self.role] = ws[i].address, "round_robin"
            return ws[i:] + ws[:i]
        route.picks[self.role] = ranked[0].address, "least_loaded"
        if self.cfg.policy == "least_loaded":
            return ranked
        fitting = [w for w in ranked if fits(w)]
        if not fitting:  # nothing to prefer (the router's wait for decode capacity asks again every few ms)
            return ranked
        usable = (len(route.tokens) - 1) // BLOCK_SIZE  # a hit leaves the prompt's last token to compute
        keys, now = route.keys[:usable], time.monotonic()
        with self._lock:
            hits = {w.address: self.index.match(w.address, keys, now) for w in fitting}
        best = max(fitting, key=lambda w: hits[w.address])
        if not hits[best.address] or hits[best.address] * BLOCK_SIZE < self.cfg.cache_threshold * len(route.tokens):
            return ranked
        low, high = min(load(w) for w in ranked), load(best)
        if high - low > self.cfg.balance_abs_threshold and high > self.cfg.balance_rel_threshold * low:
            return ranked
        route.picks[self.role] = best.address, "prefix_hit"
        return [best, *(w for w in ranked if w is not best)]

    def placed(self, worker, route: Route, tokens: list[int] | None = None) -> None:
        """`worker` took the request: it will hold the prompt's blocks (or those of `tokens`, which start with the
        prompt) in its cache."""
        if self.cfg.policy != "cache_aware":
            return
        keys = route.keys if tokens is None else route.keys_of(tokens)
        capacity = worker.load.total_kv_tokens // BLOCK_SIZE or DEFAULT_CAPACITY
        with self._lock:
            self.index.add(worker.address, keys, time.monotonic(), capacity)

    def forget(self, address: str) -> None:
        with self._lock:
            self.index.forget(address)
