"""Structured outputs: grammars compile or are refused, and the mask follows the grammar."""

import json

import pytest
import tokenizers
import torch

from kvtool.engine.core.structured_output import StructuredOutputs
from kvtool.engine.errors import InputError
from kvtool.engine.params import StructuredOutputsParams
from kvtool.engine.worker.sampler import unpack_bitmask



@pytest.fixture
def so(tiny_model_dir):
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    tok = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    structured = StructuredOutputs(tok.to_str, cfg["vocab_size"], [EOS])
    structured.vocab = cfg["vocab_size"]
    return structured


EOS = 258


def _allowed(so, rid) -> set[int]:
    return set(torch.nonzero(unpack_bitmask(so.bitmask(rid).unsqueeze(0), so.vocab)[0]).flatten().tolist())


def test_choice_mask_follows_the_grammar_to_eos(so):
    so.add("r", StructuredOutputsParams(choice=["yes", "no"]))
    assert _allowed(so, "r") == {ord("y"), ord("n")}
    so.advance("r", [ord("n")])
    assert _allowed(so, "r") == {ord("o")}
    so.advance("r", [ord("o")])
    assert _allowed(so, "r") == {EOS}


def test_json_schema_mask_starts_an_object(so):
    so.add("r", StructuredOutputsParams(json={"type": "object"}))
    assert _allowed(so, "r") == {ord("{")}


@pytest.mark.parametrize("spec", [
    StructuredOutputsParams(regex="("),
    StructuredOutputsParams(json=json.dumps([1, 2])),
    StructuredOutputsParams(grammar="start: nothing_defined"),
])
def test_malformed_grammars_are_input_errors(so, spec):
    with pytest.raises(InputError):
        so.add("r", spec)


def test_exactly_one_kind():
    with pytest.raises(InputError):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(InputError):
        StructuredOutputsParams()
