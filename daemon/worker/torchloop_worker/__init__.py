"""torchloopd's compile worker, as a package (compile_worker.py beside it is
the script the daemon starts).

One job compiles one scan specialization -- (tree structure, leaf shapes,
dtype, T, kind) of one adapter body -- with torch.export + AOTInductor into a
bare shared object, and replies with the graph's flat signature.  The
compiled graph is flat: its inputs are the tensor leaves of carry then inputs
(None leaves dropped, depth-first, dict order kept), and its outputs the
tensor leaves of the final carry then of the stacked outputs (then, for kind
"vjp" and "vjp_checkpoint", the gradients for the carry's and the inputs'
tensor leaves; the saved pair, "forward_save" and "backward_saved", lays
its own out: saved.py).  The daemon owns the trees; the graph only sees tensors.
Errors map to protocol codes (proto/protocol.h); nothing falls back to eager.

Modules, in the order a job meets them:
  frames       the daemon's framing on stdin/stdout, the log
  isa          the target ISA hello reports, remembered across starts
  job          Job (a request parsed), the body it names (source or graph)
  graph_loader captured step graphs loaded as data (no pickle, no code)
  specs        specs and trees of tensors; symbolic-batch specs
  scan         Scan: the body stepped T times, as the scan op, or in blocks
  blocked      strategy block<K>: the scan op over blocks of unrolled steps
  lowering     export / make_fx of the forward or VJP graph, OutModule
  checkpoint   the checkpointed VJP (saved carries, recomputed steps)
  saved        the joint graph split by min cut: a forward that keeps saved, its backward
  build        AOTInductor builds the daemon can unload
  codegen_speed Inductor's C++ codegen without a set-up it repeats per op
  aoti_split   the AOTI runtime interface compiled once, linked into each build
  index_guard  Inductor's index checks as a flag and a clamp, not a throw
  dispatch_calls ops without a C shim called through aoti_torch_call_dispatcher
  wrapper_pass less per-call work in the generated wrapper (subgraph buffers, views)
  loop_pass    the scan op's loop without per-iteration allocations and handles
  loop_slots   that loop's tensors, and the run's small buffers, as pointers into one allocation
  stack_into   the post-grad pass placing stacked results into the buffers
  elf          artifact checks (proxy executor, exec stack, unique symbols)
  parity       the new artifact against the eager scan
  errors       JobError and the classification of failures
  compile      a compile job from start to reply
The daemon's cache keys digest every module here (daemon/server/worker_target.c).
"""

MIN_TORCH = (2, 14)
# The worker protocol's version, checked by the daemon at hello
# (daemon/base/compiler.h WORKER_PROTOCOL).
PROTOCOL = 1
