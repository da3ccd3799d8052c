"""to_inference: the serving graph of a captured training step.

From a training StepGraph (forward, backward, optimizer): the forward phase only, each dropout replaced
by its input, each training-mode batch norm in its eval form (normalising with the running statistics,
which it no longer updates), and one chosen user output (e.g. the logits) instead of the loss.
Optimizer state, the backward phase and the random-number state drop out; parameters and buffers stay
state inputs, returned unchanged. The result verifies and runs on the reference interpreter.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ._errors import ConfigError
from ._phase_split import phase_split
from ._signature import Signature
from ._step import DROPOUT_KEY, RNG_MASK_KEY, StepGraph

INFERENCE_KEY = "recir.inference"
_BN_TRAIN = torch.ops.aten._native_batch_norm_legit_functional.default
_BN_EVAL = torch.ops.aten._native_batch_norm_legit_no_training.default


def to_inference(step: StepGraph, output: str | int = 1, *, narrow: bool = True) -> StepGraph:
    """The inference StepGraph of ``step`` (not modified), returning only user output ``output``: its
    name (``"aux.0"``, as in ``step.signature.outputs``) or index (default 1, the first output after
    the loss). ``meta["recir.inference"]`` records the output and what was rewritten.

    ``narrow`` (default): then ``recir-cleanup-narrow`` computes only the rows that the chosen output
    reads where it slices a value (a ranking head reading its candidates' rows after the last layer ran
    every token): the same values, fewer rows.

    Raises ``ConfigError`` for an unknown output, or a dropout capture did not tag (a graph captured
    before recir-capture tagged dropouts: capture it again).
    """
    names = [o.name for o in step.signature.outputs]
    index = output if isinstance(output, int) else names.index(output) if output in names else -1
    if not 0 <= index < len(names):
        raise ConfigError(
            f"to_inference: no user output {output!r}; the step's outputs are {names}. Fix: pass one of "
            "them (by name or index), e.g. the logits loss_fn returns after the loss."
        )
    fwd = phase_split(step, "forward")
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(fwd.graph, env)
    n_state = len(fwd.signature.state)
    state_out, user_out = list(out[:n_state]), list(out[n_state:])
    dropouts = batch_norms = 0
    for node in list(graph.nodes):
        if node.meta.get(DROPOUT_KEY) is not None:
            node.replace_all_uses_with(node.args[0])
            dropouts += 1
        elif node.target is _BN_TRAIN and node.args[5]:
            x, w, b, mean, var, _training, momentum, eps = node.args
            with graph.inserting_before(node):
                ev = graph.call_function(_BN_EVAL, (x, w, b, mean, var, momentum, eps))
            ev.meta = {**node.meta, "val": tuple(node.meta["val"][:3])}
            for user in list(node.users):  # getitem 0..2; 3 and 4 (new running stats) are dead here
                if user.args[1] < 3:
                    user.replace_input_with(node, ev)
            batch_norms += 1
    graph.output(tuple(state_out + [user_out[index]]))
    graph.eliminate_dead_code()
    left = [n for n in graph.nodes if n.meta.get(RNG_MASK_KEY) is not None or n.target is _BN_TRAIN]
    if left:
        raise ConfigError(
            f"to_inference: %{left[0].name} is still training-only after the rewrite (a dropout mask that "
            "recir-capture did not tag, or batch statistics). Fix: capture the step again with this "
            "version of recir-capture."
        )
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    kept = [i for i in range(n_state) if any(u.op != "output" for u in placeholders[i].users)]
    for i in reversed(range(n_state)):
        if i not in kept:
            out_node = graph.output_node()
            out_node.args = (tuple(a for j, a in enumerate(out_node.args[0]) if j != i),)
            graph.erase_node(placeholders[i])
    gm = fx.GraphModule(fwd.graph_module, graph)
    sig = fwd.signature
    signature = Signature(
        state=tuple(sig.state[i] for i in kept),
        batch=sig.batch,
        outputs=(sig.outputs[index],),
        batch_spec=sig.batch_spec,
    )
    report = {"output": names[index], "dropouts_removed": dropouts, "batch_norms_to_eval": batch_norms}
    served = fwd.replace(graph_module=gm, signature=signature, meta={**fwd.meta, INFERENCE_KEY: report})
    if narrow:
        from ._transforms.narrow import Narrow

        report["nodes_narrowed"] = Narrow().run(served).stats["narrowed"]
    return served
