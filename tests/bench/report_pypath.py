"""docs/performance.md's part for tests/bench/pypath.py (report.py calls it):
the solver's own path against torch.compile in process, and its targets."""

from __future__ import annotations

from mdtable import ratio as _x
from mdtable import table as _table
from mdtable import us


def _us(v: float) -> str:
    """µs with a decimal below 100 (report.us rounds from 10 on): the small
    rows' differences are a few µs."""
    return us(v) if v >= 100 else f"{v:.1f}"


def _shape(r: dict) -> str:
    return f"[{r['N']}, 32]" if r["body"] == "gru" else f"[{r['N']}]"


def _vjp(p: dict) -> str:
    return _us(p["g_vjp"]) if "g_vjp" in p else "–"


def _local(p: dict, mark: str = "") -> str:
    """(g local)'s p50 (a pypath.json from before local runs has none)."""
    return _us(p["g_local"]) + mark if "g_local" in p else "–"


def _local_x(p: dict, den: str) -> str:
    return _x(p["g_local"] / p[den]) if "g_local" in p else "–"


# bench.json's floors that bound the solver's path (bench_c sockpair: an echo
# process built as the daemon's loop is), each with what it stands for
FLOORS = [("sockpair_poll", "the echo, both sides polling, as the daemon's loop and its "
                            "clients do around a small request run on the loop"),
          ("sockpair_runner_poll", "the echo handing each request to a second thread and "
                                   "back (condition variable, eventfd), both sides polling, as "
                                   "a run on the pool goes"),
          ("sockpair_runner", "that hand-off with both sides sleeping: a run with every "
                              "core's team (the loop does not poll after one, nor the client "
                              "for a request of 256 KiB or more)")]
POLL_BELOW = 256 << 10  # proto/busypoll.h BUSYPOLL_MAX_REQUEST: clients poll below it

fmt_us = _us


def _request_bytes(r: dict) -> int:
    """A forward row's tensor bytes sent (float64)."""
    if r["body"] == "gru":  # h [64, 32], x [T, 64, 16], six weights as params
        return 8 * (64 * 32 + r["T"] * 64 * 16 + 3 * 32 * 32 + 3 * 16 * 32)
    return 8 * (r["N"] + r["T"] * r["N"])


def _path(r: dict) -> tuple[str, str] | None:
    """(where the row's runs went, the floor that path pays) from its `ran`."""
    ran = r.get("ran")
    if not ran or not any(ran.values()):
        return None
    where = max(ran, key=lambda k: ran[k])
    if where == "inline":
        return "loop", "sockpair_poll"
    if where == "runner":
        return "team", "sockpair_runner"
    return "pool", "sockpair_runner_poll" if _request_bytes(r) < POLL_BELOW else "sockpair_runner"


def _breakdown(fwd: list[dict], floors: dict) -> str:
    """Where (g)'s forward time goes, from the rows' breakdown pass, against
    the floor of the path its runs took."""
    rows = []
    for r in fwd:
        b, path = r.get("breakdown"), _path(r)
        if not b or not r.get("run_us"):
            continue
        trip = max(b["conn_us"] - r["run_us"], 0.0)
        left = r["p50_us"]["b"] - r["run_us"]
        floor = floors.get(path[1], {}).get("p50_us") if path else None
        rows.append([r["body"], _shape(r), str(r["T"]), _us(b["total_us"]), _us(b["python_us"]),
                     _us(trip), _us(r["run_us"]), _us(r["p50_us"]["b"]), _us(left),
                     path[0] if path else "–", _us(floor) if floor is not None else "–",
                     _us(left - b["python_us"] - floor) if floor is not None else "–"])
    if not rows:
        return ""
    return f"""Where (g)'s time goes (forward, µs, medians over one more set of calls
after the rounds): "package" is the Python of `loop_adapter(...).scan` around
the C round trip (the tree, the capture's guard, autograd's Function when
gradients are on, the region's bookkeeping); "round trip" is the C call
(`_fast.Conn.call`: the codec, the copy of what is not in the region yet, the
socket both ways, the daemon's event loop, the hand-offs to and from the
thread that runs the graph, and every wake-up) minus the graph's run; "run"
is the graph's own run time in the daemon (`stats`' p50); "(b) − run" is what
the in-process call leaves for everything else. "path": where the daemon ran
the row's graphs (`stats`: on its event loop, on the runner with every core's
OpenMP team, or on the pool with one thread), and "floor" what that path costs
with no work in it on this machine (below); "slack" = (b) − run − package −
floor: what the codec and the daemon's own work may take for (g) to reach
(b). A negative slack means that on this path no daemon could: the graph, the
package's Python and a bare round trip already take longer than the whole
in-process call.

{_table(["body", "carry", "T", "(g)", "package", "round trip", "run", "(b) in process",
         "(b) − run", "path", "floor", "slack"], rows, "llrrrrrrrlrr")}
"""


def _floor(fl: dict) -> str:
    """The round trips with no work in them that bound (g) from below."""
    rows = [[k, _us(fl[k]["p50_us"]), what] for k, what in FLOORS if k in fl]
    if not rows:
        return ""
    return f"""The floors (`bench.json` → `floors`, this run; "Where the time goes"
has them with the others): a 228-byte round trip to an echo process built as
the daemon's loop is (`bench_c sockpair`), p50 µs:

{_table(["floor", "p50", "what it is"], rows, "lrl")}
"""


def section(d: dict, floors: dict) -> str:
    if not d:
        return "## The solver's path\n\n(pypath.json missing: run `make bench`.)\n"
    fwd = [r for r in d["warm"] if r["mode"] == "fwd"]
    bwd = [r for r in d["warm"] if r["mode"] == "bwd"]
    frows = []
    for r in fwd:
        p = r["p50_us"]
        frows.append([r["body"], _shape(r), str(r["T"]), _us(p["a"]), _us(p["b"]), _us(p["g"]),
                      _us(p["g_fb"]), _local(p), _us(r["run_us"]) if r.get("run_us") else "–",
                      _x(p["g"] / p["b"]), _x(p["g_fb"] / p["b"]), _local_x(p, "b"),
                      _local_x(p, "g"), f"{r['max_diff']:.1e}"])
    brows = [[r["body"], _shape(r), str(r["T"]), _us(r["p50_us"]["b"]), _us(r["p50_us"]["g"]),
              _vjp(r["p50_us"]), _local(r["p50_us"], " ¹"),
              _x(r["p50_us"]["g"] / r["p50_us"]["b"]),
              str(r.get("contended_runs", "–")), f"{r['max_diff']:.1e}"] for r in bwd]
    first = [[r["body"], str(r["T"]), f"{r['b']['first_s']:.2f}", f"{r['g']['first_s']:.2f}",
              f"{r['g_eager']['first_s']:.2f}", _x(r["g"]["first_s"] / r["b"]["first_s"]),
              _x(r["g_eager"]["first_s"] / r["b"]["first_s"])] for r in d["first"]]
    return f"""## The solver's path: `loop_adapter(...).scan` against torch.compile in process

`tests/bench/pypath.py`: what a solver calls, with plain torch tensors. (a)
the eager loop; (b) `torch.compile(fullgraph=True, dynamic=False)` of that
loop in process (the reference adapter's way); (g) `loop_adapter(max_steps=128,
max_elements=1048576).scan`, the same carry every call; (g fb) the carry fed
back from the previous reply, as a solver's loop does; (g local) the same
scan with `run="local"`: the daemon's compiled graph run in the solver's
process (docs/python.md, "Local runs"), checked equal to (g) (`torch.equal`)
before it is timed. Bodies: ema, `c = 0.9 c
+ 0.1 tanh(x)` float64; gru, a GRU-like cell whose weights are closure
tensors (sent as params). p50 per call, the methods in turn for
{d['rounds']} rounds, median round; "daemon run" is the graph's own run time
in the daemon (its p50 from `stats`), so (g) minus it is the round trip: the
client's tree and codec work, the copy of inputs into the region, the socket
and the wake-ups. Every row first checked (g) against (b) (max |difference|,
results and, below, gradients).

{_table(["body", "carry", "T", "(a) eager", "(b) in process", "(g)", "(g fb)", "(g local)",
         "daemon run", "(g)/(b)", "(g fb)/(b)", "(g local)/(b)", "(g local)/(g)", "max diff"],
        frows, "llrrrrrrrrrrrr")}

Forward and first-order backward, `f, ys = scan(...); (f.sum() +
ys.sum()).backward()`, carry and inputs requiring grad (µs). (g): the saved
pair, as in process: the forward keeps what torch's min-cut partitioner
chose, in the client's region, and the backward starts from it (gru's
weights do not require grad: its backward computes no gradient for them);
(g vjp): `save=False`, the backward runs the VJP graph, which computes the
forward again:

{_table(["body", "carry", "T", "(b) in process", "(g)", "(g vjp)", "(g local)", "(g)/(b)",
         "contended runs", "max grad diff"], brows, "llrrrrrrrr")}

¹ a `run="local"` adapter's scan with gradients runs in the daemon today
(forward and backward, the saved pair): this column is the daemon path
through a second adapter, its gradients checked equal to (g)'s.

"contended runs": the daemon's runs with every core's OpenMP team counted as
contended during the row (`stats.contended_runs`: the team's runs, averaged,
over 4 times the fastest one-thread run; daemon/graph/team.h): the
client's own torch (the sums, the backward's copies) leaves a libgomp worker
spinning for milliseconds on one of the two cores, and the daemon's team
waits for it at every barrier; the specialization's runs then take one
thread for a while (docs/architecture.md, "Threads and ownership").

{_breakdown(fwd, floors)}
{_floor(floors)}

First call of a new body in a fresh process (the example bodies, tier.py's
trees; seconds of the first scan, its compile included): (b) with an Inductor
cache of its own; (g) against a fresh daemon with the defaults (the quick tier
on), without and with `eager_first`; Inductor's FX graph cache off on both
sides:

{_table(["body", "T", "(b) first call (s)", "(g) first call (s)", "(g) eager_first (s)",
         "(g)/(b)", "eager_first/(b)"], first, "lrrrrrr")}
"""


def targets(d: dict) -> list[list[str]]:
    """The issue's targets for the Python path, as rows of "Against the targets"."""
    if not d or not d["warm"]:
        return []

    def verdict(name: str, pairs: list[tuple[str, float]], bound: float) -> list[str]:
        lost = [f"{k} ({_x(v)}×)" for k, v in pairs if v > bound]
        won = [f"{k} {_x(v)}×" for k, v in pairs if v <= bound]
        said = ("**missed** for " + ", ".join(lost) if lost else "met") + (": " if not lost else "; ")
        return [name, said + ", ".join(won) if won else said.rstrip(":; ")]

    def key(r: dict) -> str:
        return f"{r['body']} {_shape(r)} T = {r['T']}"

    fwd = [r for r in d["warm"] if r["mode"] == "fwd"]
    bwd = [r for r in d["warm"] if r["mode"] == "bwd"]
    rows = [verdict("(g fb) ≤ 1.0× (b), forward",
                    [(key(r), r["p50_us"]["g_fb"] / r["p50_us"]["b"]) for r in fwd], 1.0),
            verdict("(g) ≤ 1.1× (b), forward",
                    [(key(r), r["p50_us"]["g"] / r["p50_us"]["b"]) for r in fwd], 1.1),
            verdict("(g) ≤ 1.0× (b), forward + backward",
                    [(key(r), r["p50_us"]["g"] / r["p50_us"]["b"]) for r in bwd], 1.0)]
    local = [r for r in fwd if "g_local" in r["p50_us"]]
    if local:
        rows.append(verdict("(g local) ≤ 0.9× (b), forward",
                            [(key(r), r["p50_us"]["g_local"] / r["p50_us"]["b"]) for r in local],
                            0.9))
        rows.append(verdict("run=\"local\" default: (g local) ≤ 1.0× (g), forward (idle)",
                            [(key(r), r["p50_us"]["g_local"] / r["p50_us"]["g"]) for r in local],
                            1.0))
    if d["first"]:
        rows.append(verdict("first call ≤ 1.0× the in-process compile (default adapter)",
                            [(f"{r['body']} T = {r['T']}", r["g"]["first_s"] / r["b"]["first_s"])
                             for r in d["first"]], 1.0))
        rows.append(verdict("first call ≤ 1.0× the in-process compile (eager_first)",
                            [(f"{r['body']} T = {r['T']}",
                              r["g_eager"]["first_s"] / r["b"]["first_s"]) for r in d["first"]],
                            1.0))
    return rows
