"""loss_parallel's backward handlers, kept for joint traces that run at the same time on
several threads (ranks as threads): the first trace to end must not take them from the others."""

from __future__ import annotations

import threading

import torch
from torch import fx

from dynamo_vars.dtensor_state import _is_backward_op, _loss_ops, loss_parallel_backward, set_loss_parallel


def _graph_entering_loss_parallel() -> fx.GraphModule:
    graph = fx.Graph()
    graph.call_function(set_loss_parallel, (True,))
    graph.output(None)
    return fx.GraphModule(torch.nn.Module(), graph)


def test_backward_handlers_stay_while_any_thread_traces_and_go_with_the_last():
    loss_ops, handlers = _loss_ops()
    backward = sorted((op for op in loss_ops if _is_backward_op(op)), key=str)
    assert backward and not any(op in handlers for op in backward)  # outside loss_parallel()
    gm = _graph_entering_loss_parallel()
    both_in, first_out = threading.Barrier(2), threading.Event()
    seen: dict[str, list[bool]] = {}

    def trace(name: str, ends_first: bool) -> None:
        with loss_parallel_backward(gm):
            # The joint trace runs the forward's loss_parallel() block, then the backward.
            set_loss_parallel(True)
            set_loss_parallel(False)
            both_in.wait()
            if not ends_first:
                first_out.wait()
            seen[name] = [op in handlers for op in backward]
        if ends_first:
            first_out.set()

    threads = [threading.Thread(target=trace, args=("first", True)), threading.Thread(target=trace, args=("second", False))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert seen == {"first": [True] * len(backward), "second": [True] * len(backward)}
    assert not any(op in handlers for op in backward)  # the table as the first trace found it
