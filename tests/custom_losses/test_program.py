"""Decoding and running uploaded custom losses, without a server.

Every loss is traced and encoded by the SDK itself (``trace_loss`` + ``encode_graph``, what
``create_custom_loss`` uploads), decoded here from its JSON form, and run; its value, metrics
and gradient must equal those of the SDK's own traced module (what ``forward_backward_custom``
runs client-side). Hostile graphs are written by hand, as an attacker would send them.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from tests.custom_losses.losses import LOSSES
from tinsmith.custom_losses import RunLimits, decode_custom_loss
from tinsmith.custom_losses.interpreter import run_loss, warm_up
from tinsmith.errors import InvalidInputError

LIMITS = RunLimits(max_elements=1 << 20, timeout_s=5.0)
CPU = torch.device("cpu")


def wire(fn, ranks):
    """What the SDK uploads for ``fn``: (name, inputs, graph) as JSON values."""
    handle = trace_loss(fn, ranks, "session")
    inputs = [x.model_dump() for x in handle.inputs]
    graph = json.loads(encode_graph(handle).model_dump_json())
    return handle, handle.name, inputs, graph


def sample_inputs(name: str, gen: torch.Generator) -> list[torch.Tensor]:
    T, K = 7, 3
    if name == "topk_distill":
        lp = torch.log_softmax(torch.randn(T, K, generator=gen), -1)
        return [lp, torch.softmax(torch.randn(T, K, generator=gen), -1)]
    lp = -torch.rand(T, generator=gen) * 3
    others = {
        "weighted_nll": [torch.rand(T, generator=gen)],
        "ppo_clipped": [lp + 0.3 * torch.randn(T, generator=gen), torch.randn(T, generator=gen)],
        "dpo_style": [lp - 0.5 * torch.rand(T, generator=gen), (torch.arange(T) > 2).float(), torch.tensor(-1.0)],
    }[name]
    return [lp, *others]


def run(loss, values, limits=LIMITS):
    warm_up()
    return run_loss(loss, values, CPU, limits, time.monotonic() + limits.timeout_s)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_sdk_losses_match_the_sdk_module_in_value_metrics_and_gradient(name):
    fn, ranks = LOSSES[name]
    handle, loss_name, inputs, graph = wire(fn, ranks)
    program = decode_custom_loss(loss_name, inputs, graph, max_nodes=100)
    assert program.input_names == handle.input_names
    values = sample_inputs(name, torch.Generator().manual_seed(5))

    ours_lp = values[0].clone().requires_grad_(True)
    ours, ours_metrics = run(program, [ours_lp, *values[1:]])
    ours.backward()
    ref_lp = values[0].clone().requires_grad_(True)
    ref, ref_metrics = handle.graph(ref_lp, *values[1:])
    ref.backward()

    assert float(ours.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    assert ours_lp.grad is not None and torch.count_nonzero(ours_lp.grad) > 0
    torch.testing.assert_close(ours_lp.grad, ref_lp.grad)
    assert set(ours_metrics) == set(ref_metrics)
    for key in ref_metrics:
        assert float(ours_metrics[key]) == pytest.approx(float(ref_metrics[key]), rel=1e-6)


def test_a_different_loss_gives_a_different_result():
    """Control: the comparison above can fail (two losses on the same inputs differ)."""
    values = sample_inputs("weighted_nll", torch.Generator().manual_seed(5))
    a = decode_custom_loss(*wire(*LOSSES["weighted_nll"])[1:], max_nodes=100)
    b_fn = lambda logprobs, weights: ((-(logprobs * weights).mean()), {})  # noqa: E731
    b_fn.__name__ = "mean_nll"
    b = decode_custom_loss(*wire(b_fn, {"logprobs": 1, "weights": 1})[1:], max_nodes=100)
    assert float(run(a, values)[0]) != pytest.approx(float(run(b, values)[0]))


# ------------------------------------------------------------------------------------ hostile graphs
def graph_with(*calls, output="x"):
    """A graph over one input ``logprobs`` (rank 1) with the given call nodes, returning ``output``."""
    nodes = [{"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}}]
    nodes += list(calls)
    nodes.append({"op": "output", "name": "output", "target": "output",
                  "args": [{"tuple": [{"ref": output}, {"dict": {}}]}], "kwargs": {}})
    return {"format": 1, "nodes": nodes}


def call(name, target, *args, op="call_function", **kwargs):
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": kwargs}


LP = {"ref": "logprobs"}
INPUTS = [{"name": "logprobs", "rank": 1}]


def refused_at_decode(graph, match):
    with pytest.raises(InvalidInputError, match=match):
        decode_custom_loss("hostile", INPUTS, graph, max_nodes=64)


@pytest.mark.parametrize("target", [
    "os.system", "subprocess.run", "builtins.eval", "builtins.exec", "builtins.__import__", "importlib.import_module",
    "torch.load", "torch.save", "torch.from_file", "torch.empty", "torch.rand", "torch.ops.aten.add",
    "torch.Tensor.add_", "pickle.loads", "builtins.open", "torch.autograd.grad", "torch.hub.load",
])
def test_functions_off_the_list_are_refused_by_name(target):
    refused_at_decode(graph_with(call("x", target, LP)), f"node 'x'.*{target}")


@pytest.mark.parametrize("method", ["add_", "copy_", "item", "tolist", "numpy", "backward", "__class__",
                                    "__reduce__", "storage", "untyped_storage", "data_ptr", "register_hook"])
def test_methods_off_the_list_are_refused_by_name(method):
    refused_at_decode(graph_with(call("x", method, LP, op="call_method")), f"call_method '{method}'")


@pytest.mark.parametrize("attr", ["__class__", "__dict__", "grad_fn", "_base", "data", "__globals__"])
def test_getattr_reads_only_listed_tensor_attributes(attr):
    refused_at_decode(graph_with(call("x", "getattr", LP, attr)), f"getattr of '{attr}'")


def test_getattr_chains_to_python_objects_are_refused():
    """``x.__class__.__init__.__globals__``: the first link already fails."""
    graph = graph_with(call("a", "getattr", LP, "__class__"), call("b", "getattr", {"ref": "a"}, "__init__"),
                       call("x", "getattr", {"ref": "b"}, "__globals__"))
    refused_at_decode(graph, "node 'a'.*getattr of '__class__'")


@pytest.mark.parametrize("op", ["get_attr", "call_module"])
def test_module_and_attribute_nodes_are_refused(op):
    refused_at_decode(graph_with({"op": op, "name": "x", "target": "os", "args": [], "kwargs": {}}), f"op '{op}'")


@pytest.mark.parametrize("arg, match", [
    ({"pickle": "gASV"}, "not allowed"),
    ({"dtype": "object"}, "not allowed"),
    ({"ref": "later"}, "not an earlier node"),
    ({"ref": "x"}, "not an earlier node"),  # itself: no cycles
    ({"tuple": [[[[[[1]]]]]]}, "nest deeper"),
    (10 ** 30, "int64"),
    ("a" * 1000, "at most 64 characters"),
    ({"ref": "logprobs", "extra": 1}, "not an encoded value"),
])
def test_bad_arguments_are_refused_naming_the_node(arg, match):
    refused_at_decode(graph_with(call("x", "torch.add", LP, arg)), f"node 'x'.*{match}")


def test_out_keyword_is_refused():
    refused_at_decode(graph_with(call("x", "torch.exp", LP, out=LP)), "'out' is not allowed")


def test_too_many_nodes_are_refused_before_decoding():
    calls = [call(f"n{i}", "torch.exp", LP) for i in range(100)]
    refused_at_decode(graph_with(*calls, output="n0"), "100|at most 64 nodes")


def test_output_must_be_loss_and_metrics():
    graph = graph_with(call("x", "torch.exp", LP))
    graph["nodes"][-1]["args"] = [{"tuple": [{"ref": "x"}, {"dict": {"loss:sum": {"ref": "x"}}}]}]
    refused_at_decode(graph, "custom/<name>:sum")
    graph["nodes"][-1]["args"] = [{"ref": "x"}]
    refused_at_decode(graph, r"\(loss, metrics\)")


def test_placeholders_must_match_the_declared_inputs():
    graph = graph_with(call("x", "torch.exp", LP))
    graph["nodes"][0]["target"] = "weights"
    refused_at_decode(graph, "placeholder 'weights'")


# ------------------------------------------------------------------------------------ runtime bounds
def run_hostile(graph, values=None, limits=LIMITS):
    program = decode_custom_loss("hostile", INPUTS, graph, max_nodes=64)
    return run(program, values or [torch.zeros(4, requires_grad=True)], limits)


def test_huge_tensor_creation_is_refused_before_it_allocates():
    graph = graph_with(call("x", "torch.ones", 10 ** 12))
    warm_up()  # torch's one-time meta set-up (seconds on a cold process), done before a server's first loss
    started = time.monotonic()
    with pytest.raises(InvalidInputError, match=r"node 'x'.*1000000000000 elements.*--custom-loss-max-elements"):
        run_hostile(graph)
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("node", [
    call("x", "expand", {"ref": "v"}, -1, 10 ** 6, op="call_method"),
    call("x", "torch.full", {"tuple": [100000, 100000]}, 1.0),
    call("x", "new_ones", LP, {"tuple": [1 << 40]}, op="call_method"),
    call("x", "torch.arange", 0, 10 ** 15),
    call("x", "operator.mul", {"ref": "v"}, {"ref": "row"}),  # an outer product by broadcasting
])
def test_size_is_checked_for_every_way_of_making_a_large_tensor(node):
    graph = graph_with(call("v", "view", LP, -1, 1, op="call_method"),
                       call("row", "view", LP, 1, -1, op="call_method"), node)
    with pytest.raises(InvalidInputError, match="node 'x'.*elements"):
        run_hostile(graph, [torch.zeros(20000)], RunLimits(max_elements=1 << 20, timeout_s=5.0))


@pytest.mark.parametrize("node", [
    call("x", "split", LP, 1, op="call_method"),
    call("x", "torch.unbind", LP),
    call("x", "torch.chunk", LP, 100000),
])
def test_splitting_into_many_pieces_is_refused_before_it_runs(node):
    with pytest.raises(InvalidInputError, match="node 'x'.*pieces"):
        run_hostile(graph_with(node), [torch.zeros(1 << 20)])


def test_a_small_split_runs():
    graph = graph_with(call("parts", "split", LP, 2, op="call_method"),
                       call("first", "operator.getitem", {"ref": "parts"}, 1),
                       call("x", "sum", {"ref": "first"}, op="call_method"))
    loss, _ = run_hostile(graph, [torch.arange(6.0)])
    assert float(loss) == 2.0 + 3.0


def test_huge_python_numbers_are_refused():
    graph = graph_with(call("n", "operator.pow", 10, 10 ** 9), call("x", "torch.mul", LP, {"ref": "n"}))
    with pytest.raises(InvalidInputError, match="node 'n'.*power"):
        run_hostile(graph)
    graph = graph_with(call("n", "operator.mul", 1 << 62, 1 << 62), call("x", "torch.mul", LP, {"ref": "n"}))
    with pytest.raises(InvalidInputError, match="node 'n'.*int64"):
        run_hostile(graph)
    graph = graph_with(call("n", "operator.mul", {"tuple": [1]}, 1 << 40), call("x", "torch.mul", LP, {"ref": "n"}))
    with pytest.raises(InvalidInputError, match="node 'n'"):
        run_hostile(graph)


def test_a_slow_graph_stops_at_the_time_limit():
    """fx graphs have no loops; the longest a graph can run is its node count times its slowest
    node, and the deadline is checked between nodes."""
    calls = [call("n0", "torch.sort", LP)]
    calls += [call(f"n{i}", "torch.exp", LP) for i in range(1, 60)]
    graph = graph_with(*calls, output="n59")
    with pytest.raises(InvalidInputError, match=r"time limit of 1e-06 s .*at node"):
        run_hostile(graph, [torch.zeros(100000)], RunLimits(max_elements=1 << 20, timeout_s=1e-6))


def test_runtime_errors_name_the_node():
    graph = graph_with(call("x", "operator.add", LP, {"ref": "w"}))
    graph["nodes"].insert(1, call("w", "torch.ones", 3))
    with pytest.raises(InvalidInputError, match="node 'x' \\(operator.add\\).*broadcast|size"):
        run_hostile(graph)
    graph = graph_with(call("x", "sum", 5, op="call_method"))
    with pytest.raises(InvalidInputError, match="node 'x'.*not on a tensor"):
        run_hostile(graph)


@pytest.mark.parametrize("node, match", [
    (call("x", "torch.exp", "rm -rf /"), "node 'x' \\(torch.exp\\)"),
    (call("x", "torch.sum", LP, "dim"), "node 'x'"),
    (call("x", "torch.clamp", LP, {"tuple": [1, 2]}), "node 'x'"),
    (call("x", "math.log", LP), "node 'x'"),
    (call("x", "operator.getitem", {"tuple": [1, 2]}, "a"), "node 'x'.*integers or slices"),
])
def test_wrong_argument_types_are_a_400_naming_the_node(node, match):
    with pytest.raises(InvalidInputError, match=match):
        run_hostile(graph_with(node))


def test_any_device_named_means_the_run_device():
    graph = graph_with(call("z", "new_zeros", LP, {"tuple": [4]}, op="call_method"),
                       call("y", "to", {"ref": "z"}, "cuda:7", op="call_method"),
                       call("w", "torch.zeros_like", LP), call("v", "operator.add", {"ref": "y"}, {"ref": "w"}),
                       call("x", "sum", {"ref": "v"}, op="call_method"))
    graph["nodes"][1]["kwargs"] = {"device": "cuda:7"}
    graph["nodes"][3]["kwargs"] = {"device": {"device": "cuda:3"}}
    loss, _ = run_hostile(graph)
    assert loss.device == CPU


def test_non_scalar_loss_is_refused():
    graph = graph_with(call("x", "torch.exp", LP))
    with pytest.raises(InvalidInputError, match="scalar"):
        run_hostile(graph)
