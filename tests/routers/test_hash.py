"""The worked example of extending moespec: the opt-in hash router (moespec/routers/hash.py) is one file and
one registration, and every stage serves it without knowing its name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import moespec
from moespec.compiler import moe_layers, plan_of
from moespec.errors import SpecError
from moespec.spec import json_schema
from moespec.weights import caveats

from ..conftest import TINY_CONVNEXT, TINY_INPUT, TINY_VIT, make_spec

HASH_GROUP = {"where": {"every": 1}, "experts": 4, "router": {"kind": "hash", "seed": 3}}
PATCHES = (64 // 16) ** 2 + 1  # 16 patches and the [CLS] token of the tiny ViT


def test_without_registration_hash_is_an_unknown_kind():
    with pytest.raises(SpecError, match="unknown router 'hash'; allowed: 'topk', 'expert_choice', 'soft', 'image'"):
        make_spec(TINY_VIT, [HASH_GROUP])


def test_registered_it_validates_with_its_own_options_and_joins_the_schema(hash_kind):
    spec = make_spec(TINY_VIT, [HASH_GROUP])
    assert spec.moe[0].router.seed == 3 and spec.moe[0].aux_loss == []  # nothing to balance
    with pytest.raises(SpecError) as error:
        make_spec(TINY_VIT, [{**HASH_GROUP, "router": {"kind": "hash", "sed": 1}}])
    assert [(p.path, p.message) for p in error.value.problems] == [
        ("moe.0.router.sed", "unknown key 'sed'; allowed: kind, seed; did you mean 'seed'?")]
    with pytest.raises(SpecError, match="top_k \\(2\\) does not apply to hash routers"):
        make_spec(TINY_VIT, [{**HASH_GROUP, "top_k": 2}])  # release 0.1's form: top_k on the group
    with pytest.raises(SpecError, match="unknown key 'top_k'; allowed: kind, seed; top_k is a setting of topk, image"):
        make_spec(TINY_VIT, [{**HASH_GROUP, "router": {"kind": "hash", "top_k": 2}}])
    schema = json_schema()
    assert "HashRouter" in schema["$defs"]
    assert {"$ref": "#/$defs/HashRouter"} in schema["$defs"]["MoEGroup"]["properties"]["router"]["oneOf"]


def test_each_position_has_one_fixed_expert_balanced_over_the_experts(hash_kind):
    router = hash_kind.HashRouter(num_experts=4, seed=3)
    routing = router(torch.randn(3 * PATCHES, 8), images=3)
    expert_of_item = torch.empty(3 * PATCHES, dtype=torch.long)
    expert_of_item[routing.item] = torch.arange(4).repeat_interleave(routing.counts)
    per_image = expert_of_item.reshape(3, PATCHES)
    assert torch.equal(per_image[0], per_image[1]) and torch.equal(per_image[0], per_image[2])  # by position only
    assert torch.equal(per_image[0], router.table(PATCHES, torch.device("cpu")))
    assert sorted(torch.bincount(per_image[0], minlength=4).tolist()) == [4, 4, 4, 5]  # 17 positions, 4 experts
    assert torch.equal(routing.weights, torch.ones(3 * PATCHES)) and bool(routing.kept.all())
    assert not torch.equal(router.table(PATCHES, torch.device("cpu")),
                           hash_kind.HashRouter(num_experts=4, seed=4).table(PATCHES, torch.device("cpu")))


def test_plan_build_and_train_on_tokens_and_feature_maps(hash_kind):
    pooled_vit = {**TINY_VIT, "kwargs": {**TINY_VIT["kwargs"], "global_pool": "avg"}}  # every token reaches the loss
    for backbone in (pooled_vit, TINY_CONVNEXT):
        spec = make_spec(backbone, [HASH_GROUP])
        assert {layer.router.describe(layer) for layer in moespec.plan(spec).layers} == {"hash seed=3"}
        model = moespec.create_model(spec, seed=0).train()
        loss = model(torch.randn(2, *TINY_INPUT)).square().mean() + moespec.aux_loss(model)
        loss.backward()
        for path, layer in moe_layers(model).items():
            assert layer.experts.fc1.weight.grad.flatten(1).abs().sum(1).gt(0).all(), path  # every expert learned


def test_an_upcycled_hash_layer_is_exactly_the_dense_ffn(hash_kind, dense_checkpoint):
    path, dense = dense_checkpoint(TINY_VIT)
    model = moespec.upcycle(make_spec(TINY_VIT, [HASH_GROUP]), path).eval()
    assert caveats(plan_of(model)) == ()
    x = torch.randn(2, *TINY_INPUT)
    with torch.no_grad():
        torch.testing.assert_close(model(x), dense(x), atol=1e-5, rtol=1e-5)


def test_stats_activate_one_expert_per_token(hash_kind):
    stats = moespec.stats(make_spec(TINY_VIT, [HASH_GROUP]))
    per_expert = (384 * 1536 + 1536) + (1536 * 384 + 384)  # fc1 and fc2 of ViT-S's MLP, with biases
    assert [layer.params for layer in stats.layers] == [4 * per_expert] * 2  # no router parameters
    assert [layer.activated_params for layer in stats.layers] == [per_expert] * 2
    assert stats.total_params - stats.activated_params == 2 * 3 * per_expert
    assert [layer.activated for layer in stats.layers] == ["per token"] * 2


def test_inspect_counts_every_token_once(hash_kind):
    model = moespec.create_model(make_spec(TINY_VIT, [HASH_GROUP]), seed=0).eval()
    with torch.no_grad():
        model(torch.randn(2, *TINY_INPUT))
    for layer in moe_layers(model).values():
        mass, dropped = hash_kind.HashRouterSpec.inspection.tally(layer)
        assert mass.shape == (2, 4) and dropped == 0.0
        assert mass.sum(dim=1).tolist() == [PATCHES, PATCHES]  # a share row sums to 1


def test_the_seed_is_bounded_by_what_torch_takes(hash_kind):
    """A seed of 2**64 overflows torch.Generator.manual_seed (ValueError: Overflow when unpacking long long)."""
    assert make_spec(TINY_VIT, [{**HASH_GROUP, "router": {"kind": "hash", "seed": 2**64 - 1}}])
    with pytest.raises(SpecError, match="moe.0.router.seed: input should be between 0 and 18446744073709551615"):
        make_spec(TINY_VIT, [{**HASH_GROUP, "router": {"kind": "hash", "seed": 2**64}}])


@pytest.mark.parametrize("images, tokens", [(0, 5), (3, 1)], ids=["empty_batch", "one_token"])
def test_an_empty_batch_and_one_token_route_as_the_dense_ffn_runs(hash_kind, images, tokens):
    bank = moespec.layers.Experts(3, 4, 6, 4, act=torch.nn.GELU())
    layer = moespec.layers.MoE(hash_kind.HashRouter(num_experts=3), bank)
    x = torch.randn(images, tokens, 4, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.shape == x.shape and x.grad.shape == x.shape


def test_the_readme_worked_example_is_the_file():
    """docs/extending.md's "Worked example" is `moespec/routers/hash.py` after its docstring, as it is."""
    root = Path(__file__).parents[2]
    readme = (root / "docs" / "extending.md").read_text(encoding="utf-8")
    section = readme[readme.index("**Worked example: a hash router.**"):]
    block = section[section.index("```python\n") + len("```python\n"):section.index("```\n", 10)]
    code = (root / "moespec" / "routers" / "hash.py").read_text(encoding="utf-8")
    assert block == code[code.index("from __future__"):]
