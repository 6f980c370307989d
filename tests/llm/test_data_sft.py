"""SFT data: JSONL parsing errors, separate encoding + shift + mask, loader contract."""
import json
import os

import numpy as np
import pytest

from pipeline.errors import UserError
from pipeline.llm.data import (IGNORE_INDEX, PIRATE_PAIRS, EncodeOptions, Loader, Pair, encode_pair,
                               epoch_permutation, load_jsonl, pairs_from_records)

GOLDENS = os.path.join(os.path.dirname(__file__), "..", "goldens", "lora")


class StubTokenizer:
    """Bytes + special tokens, with one BPE merge ("ab") to expose boundary merging."""
    SPECIAL = {"<|im_start|>": 1000, "<|im_end|>": 1001}
    MERGE = 999  # "ab"

    def encode(self, text):
        ids, i = [], 0
        while i < len(text):
            for tok, tid in self.SPECIAL.items():
                if text.startswith(tok, i):
                    ids.append(tid)
                    i += len(tok)
                    break
            else:
                if text.startswith("ab", i):
                    ids.append(self.MERGE)
                    i += 2
                else:
                    ids.append(ord(text[i]))
                    i += 1
        return ids


class StubTemplate:
    stop = "<|im_end|>"

    def render_prompt(self, instruction, system=None, think_off=True):
        sys_turn = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
        think = "<think>\n\n</think>\n\n" if think_off else ""
        return f"{sys_turn}<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n{think}"


TOK, TPL = StubTokenizer(), StubTemplate()


def test_encode_pair_shift_and_mask():
    pair = Pair("hi", "yo")
    s = encode_pair(TOK, TPL, pair)
    prompt = TOK.encode(TPL.render_prompt("hi"))
    full = prompt + TOK.encode("yo") + [1001]
    np.testing.assert_array_equal(s.inputs, full[:-1])
    # labels: prompt predictions masked, then exactly the response + stop
    assert (s.labels[: len(prompt) - 1] == IGNORE_INDEX).all()
    np.testing.assert_array_equal(s.labels[len(prompt) - 1:], full[len(prompt):])
    assert s.n_valid == 3 and s.n_prompt == len(prompt)


def test_encode_pair_encodes_prompt_and_response_separately():
    # the prompt ends with "a" (think off -> "\n\n" ends it, so use think_on + instruction trick)
    class EndsWithA(StubTemplate):
        def render_prompt(self, instruction, system=None, think_off=True):
            return "xa"
    s = encode_pair(TOK, EndsWithA(), Pair("q", "b!"))
    # joined text would merge "a"+"b" into 999; separate encoding keeps the boundary
    assert 999 not in s.inputs.tolist()
    assert s.inputs.tolist() == [ord("x"), ord("a"), ord("b"), ord("!")]
    assert s.labels.tolist() == [IGNORE_INDEX, ord("b"), ord("!"), 1001]


def test_mask_prompt_off_and_custom_ignore_index():
    s = encode_pair(TOK, TPL, Pair("hi", "yo"), EncodeOptions(mask_prompt=False))
    assert s.n_valid == len(s.labels)
    s = encode_pair(TOK, TPL, Pair("hi", "yo"), EncodeOptions(ignore_index=-1))
    assert (s.labels == -1).sum() == s.n_prompt - 1


def test_think_off_and_system_reach_the_rendering():
    on = encode_pair(TOK, TPL, Pair("hi", "yo"), EncodeOptions(think_off=False))
    off = encode_pair(TOK, TPL, Pair("hi", "yo"))
    assert off.n_prompt - on.n_prompt == len("<think>\n\n</think>\n\n")
    sys_ = encode_pair(TOK, TPL, Pair("hi", "yo"), EncodeOptions(system="be brief"))
    assert sys_.n_prompt > off.n_prompt


def test_seq_max_truncates_and_oversize_prompt_is_rejected():
    n_prompt = len(TOK.encode(TPL.render_prompt("hi")))
    s = encode_pair(TOK, TPL, Pair("hi", "a long response"), EncodeOptions(seq_max=n_prompt + 1))
    assert len(s.inputs) == n_prompt + 1 and s.n_valid == 2
    # seq_max == n_prompt - 1 leaves exactly zero supervised positions
    with pytest.raises(UserError, match=r"pair 3: sample too long.*seq_max"):
        encode_pair(TOK, TPL, Pair("hi", "yo"), EncodeOptions(seq_max=n_prompt - 1), where="pair 3")
    s = encode_pair(TOK, TPL, Pair("hi", "yo"), EncodeOptions(seq_max=n_prompt))
    assert s.n_valid == 1


def test_pirate_dataset():
    assert len(PIRATE_PAIRS) == 5
    assert all(p.response.startswith("Ahoy!") and p.response.endswith("matey.") for p in PIRATE_PAIRS)


def _write(tmp_path, text):
    p = tmp_path / "d.jsonl"
    p.write_text(text, encoding="utf-8")
    return p


def test_jsonl_roundtrip_and_custom_keys(tmp_path):
    p = _write(tmp_path, '{"instruction": "a", "response": "b"}\n\n{"instruction": "c", "response": "d"}\n')
    assert load_jsonl(p) == [Pair("a", "b"), Pair("c", "d")]
    p = _write(tmp_path, json.dumps({"q": "x", "a": "y"}) + "\n")
    assert load_jsonl(p, instruction_key="q", response_key="a") == [Pair("x", "y")]


@pytest.mark.parametrize("text,match", [
    ('{"instruction": "a", "response": "b"}\n{"instruction": "a", "respo\n', r"d\.jsonl:2: malformed JSON"),
    ('{"instruction": "a", "response": "b"}\n\n[1, 2]\n', r"d\.jsonl:3: expected a JSON object"),
    ('{"instruction": "a"}\n', r"d\.jsonl:1: missing key 'response'"),
    ('{"instruction": "a", "response": 3}\n', r"d\.jsonl:1: key 'response' must be a string"),
    ('\n\n', r"no pairs found"),
])
def test_jsonl_malformed_lines_name_the_line(tmp_path, text, match):
    with pytest.raises(UserError, match=match):
        load_jsonl(_write(tmp_path, text))


def test_jsonl_missing_file(tmp_path):
    with pytest.raises(UserError, match="cannot read"):
        load_jsonl(tmp_path / "nope.jsonl")


def test_pairs_from_records():
    assert pairs_from_records([("a", "b"), {"instruction": "c", "response": "d"}]) == [Pair("a", "b"), Pair("c", "d")]
    with pytest.raises(UserError, match="record 0"):
        pairs_from_records([{"instruction": "a"}])
    with pytest.raises(UserError, match="empty"):
        pairs_from_records([])


def test_loader_permutation_matches_goldens():
    with open(os.path.join(GOLDENS, "loader_perm.json")) as f:
        doc = json.load(f)
    for case in doc["cases"]:
        assert epoch_permutation(case["n"], case["seed"], case["epoch"]) == case["perm"], case


def test_loader_sequential_and_shuffled_epochs():
    assert Loader(3).take(7) == [0, 1, 2, 0, 1, 2, 0]
    ld = Loader(5, "shuffled", seed=42)
    first, second = ld.take(5), ld.take(5)
    assert sorted(first) == sorted(second) == list(range(5))
    assert first == epoch_permutation(5, 42, 0) and second == epoch_permutation(5, 42, 1)
    assert ld.state() == {"seed": 42, "epoch": 1, "index": 5}


def test_loader_state_resumes_the_stream():
    full = Loader(7, "shuffled", seed=3).take(30)
    ld = Loader(7, "shuffled", seed=3)
    head = ld.take(13)
    resumed = Loader.from_state(7, "shuffled", json.loads(json.dumps(ld.state())))
    assert head + resumed.take(17) == full


def test_loader_rejects_bad_config():
    with pytest.raises(UserError):
        Loader(0)
    with pytest.raises(UserError, match="order"):
        Loader(3, "random")
    with pytest.raises(UserError, match="index"):
        Loader(3, index=4)


def test_prompt_template_renders_through_the_chat_template():
    from pipeline.llm.chat import ChatTemplate
    from pipeline.llm.data import PromptTemplate
    t = PromptTemplate(ChatTemplate())  # built-in ChatML
    assert t.render_prompt("Hi?") == "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert t.render_prompt("Hi?", system="S", think_off=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n")
    assert t.stop == "<|im_end|>"
