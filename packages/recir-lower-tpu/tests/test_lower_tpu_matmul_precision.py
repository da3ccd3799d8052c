"""TPUOptions.matmul_precision: the float32 products of the lowered step carry the precision that torch's
``set_float32_matmul_precision`` (or the option) asks for, in the program itself (a TPU reads it; XLA on a
CPU computes float32 either way, so the StableHLO is what can be checked here)."""

from __future__ import annotations

import re

import pytest
import torch
from recir.lower_tpu import TPUOptions, compile
from recir.transforms import ConfigError
from torch import nn

pytestmark = pytest.mark.tpu


def _loss(model, b):
    return ((model(b["x"]) - b["y"]) ** 2).mean()


@pytest.fixture
def step(sgd_step):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    return sgd_step(model, _loss, {"x": torch.randn(4, 8), "y": torch.randn(4, 1)})


def _dot_precisions(compiled) -> set[str]:
    text = compiled.lower().as_text()
    found = set(re.findall(r"dot_general[^\n]*precision = \[(\w+), \w+\]", text))
    assert found, "no float32 dot_general with a precision in the lowered step"
    return found


@pytest.fixture
def torch_precision():
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize(
    ("torch_setting", "jax_setting", "in_hlo"),
    [("highest", "highest", "HIGHEST"), ("high", "high", "HIGH"), ("medium", "default", "DEFAULT")],
)
def test_follows_torch_float32_matmul_precision(step, torch_precision, torch_setting, jax_setting, in_hlo):
    torch_precision(torch_setting)
    compiled = compile(step)
    assert compiled.matmul_precision == jax_setting
    assert _dot_precisions(compiled) == {in_hlo}


def test_option_overrides_torch_and_stays_with_the_program(step, torch_precision):
    torch_precision("highest")
    compiled = compile(step, options=TPUOptions(matmul_precision="default"))
    assert _dot_precisions(compiled) == {"DEFAULT"}
    # bound at compile: a later change of torch's knob does not retrace this program differently
    torch_precision("medium")
    assert _dot_precisions(compile(step, options=TPUOptions(matmul_precision="highest"))) == {"HIGHEST"}
    assert _dot_precisions(compiled) == {"DEFAULT"}


def test_bad_precision_names_the_choices():
    with pytest.raises(ConfigError, match=r"matmul_precision='bf16'.*highest, high, default"):
        TPUOptions(matmul_precision="bf16")
