"""What torch.compile's partitioner saves for backward, counted while a compiled step runs.

Under ``--compile`` AOTAutograd traces each compiled region's forward and backward as one joint
graph and a partitioner cuts it in two: the forward graph returns, after the region's outputs,
the tensors the backward graph needs (the *saved* activations); everything else the backward
needs it recomputes. Inductor's min-cut partitioner chooses that cut, and
``--compile-memory-budget F`` bounds what it saves (:mod:`memtrain.techniques.compile`); no
analytic rule says what it will choose, so the tracer runs it.

:func:`partition_recording_backend` is a torch.compile backend that does what inductor does up
to the kernels: dynamo's graph, inductor's decompositions, the min-cut partitioner with
``compiler="inductor"`` (as the ``aot_eager_decomp_partition`` debug backend does), then runs
the two graphs op by op. So it runs under fake tensors (``memtrain.analysis.trace``), costs no
C++ build, and saves exactly what inductor's graphs would. Each call of a forward graph adds the
bytes of the tensors it saves to a :class:`SavedActivations`: distinct storages, leaving out
those of the graph's inputs (parameters, the batch, a block's input), which are alive anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch._functorch.config as functorch_config
from functorch.compile import min_cut_rematerialization_partition

from memtrain.metrics.storage import leaf_storages, tensors_in

__all__ = ["SavedActivations", "partition_recording_backend"]

# Where the partition leaves the count of the forward graph's own outputs; the saved tensors follow them.
_FWD_OUTPUTS = "memtrain_fwd_outputs"


@dataclass
class SavedActivations:
    """Totals over every forward graph call seen: calls, and bytes saved for backward."""

    graphs: int = 0  # forward graphs partitioned (one per compiled region and shape)
    calls: int = 0  # forward graph calls (a block-scope step calls its one graph once per block)
    saved_bytes: int = 0  # bytes of saved tensors, summed over calls


def _saved_bytes(inputs: Any, saved: Any) -> int:
    """Bytes of the distinct storages behind ``saved`` that none of ``inputs`` holds."""
    held = {id(st) for t in tensors_in(list(inputs)) for st, _ in leaf_storages(t)}
    seen: dict[int, int] = {}
    for t in tensors_in(list(saved)):
        for st, _ in leaf_storages(t):
            if id(st) not in held:
                seen[id(st)] = st.nbytes()
    return sum(seen.values())


def _recording_forward(record: SavedActivations) -> Callable[[torch.fx.GraphModule, Any], Callable[..., Any]]:
    """A forward 'compiler' that runs the graph as is and counts what each call saves."""

    def compile_forward(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        n_out = gm.meta[_FWD_OUTPUTS]
        record.graphs += 1
        graph = _run_graph(gm, example_inputs)

        def run(args: list[Any]) -> Any:
            # The graph empties ``args`` as it goes (boxed calling); the inputs are kept until the
            # count, so no storage freed meanwhile can lend its id to a saved one. They are the
            # parameters, the batch or a block's input, all held by the caller anyway.
            inputs = list(args)
            outs = graph(args)
            record.calls += 1
            record.saved_bytes += _saved_bytes(inputs, outs[n_out:])
            return outs

        run._boxed_call = True  # type: ignore[attr-defined]  # AOTAutograd's boxed protocol (make_boxed_func sets it too)
        return run

    return compile_forward


def _run_graph(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    """A graph run op by op, each input released at its last use as compiled code does (torch's
    ``boxed_nop``, the ``aot_eager`` backends' compiler); holding them all to the end would
    put a peak in backward that the compiled step does not have."""
    # Local import: torch's debugging backends module loads dynamo's backend registry.
    from torch._dynamo.backends.debugging import boxed_nop

    return boxed_nop(gm, example_inputs)


def _recording_partition(joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
    """Inductor's partition of the joint graph; the forward graph notes its own output count."""
    fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor", **kwargs)
    fw.meta[_FWD_OUTPUTS] = kwargs["num_fwd_outputs"]
    return fw, bw


def partition_recording_backend(record: SavedActivations) -> Callable[..., Any]:
    """A torch.compile backend: inductor's decompositions and partition, the graphs run op by op,
    what each forward call saves added to ``record`` (see the module docstring)."""
    # Local imports: dynamo's AOTAutograd wrapper and inductor's decomposition table load
    # inductor, which only a traced compile needs.
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import select_decomp_table

    inner = aot_autograd(fw_compiler=_recording_forward(record), bw_compiler=_run_graph,
                         decompositions=select_decomp_table, partition_fn=_recording_partition)

    def backend(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        # The effect tokens setting of torch's aot_eager_decomp_partition, the backend this copies.
        with functorch_config.patch(unlift_effect_tokens=True):
            return inner(gm, example_inputs, **kwargs)

    return backend
