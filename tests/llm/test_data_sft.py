"""SFT data: separate encoding + shift + mask on a stub tokenizer, JSONL errors, the loader contract."""
import json
import os

import numpy as np
import pytest

from pipeline.errors import UserError
from pipeline.llm.chat import ChatTemplate
from pipeline.llm.data import (IGNORE_INDEX, PIRATE_PAIRS, EncodeOptions, Loader, Pair, encode_all,
                               encode_conversation, epoch_permutation, load_jsonl, pairs_from_records)

GOLDENS = os.path.join(os.path.dirname(__file__), "..", "goldens", "lora")


class StubTokenizer:
    """Bytes + special tokens, with one BPE merge ("ab") to expose boundary merging."""
    SPECIAL = {"<|im_start|>": 1000, "<|im_end|>": 1001}
    MERGE = 999  # "ab"

    def encode(self, text, continuation=False):
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


TPL = ChatTemplate(None, stop_texts={"<|im_end|>"})  # built-in ChatML, <|im_end|> ends a turn
TOK = StubTokenizer()


def _prompt(instruction, system=None):
    sys_turn = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    return f"{sys_turn}<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n"


def test_encode_pair_shift_and_mask():
    s = encode_all(TOK, TPL, [Pair("hi", "yo")])[0]
    prompt = TOK.encode(_prompt("hi"))
    full = prompt + TOK.encode("yo") + [1001] + [ord("\n")]  # the rendered turn ends "<|im_end|>\n"
    np.testing.assert_array_equal(s.inputs, full[:-1])
    # labels: prompt predictions masked, then exactly the response + end-of-turn; the newline after it is not
    assert (s.labels[: len(prompt) - 1] == IGNORE_INDEX).all()
    np.testing.assert_array_equal(s.labels[len(prompt) - 1: -1], full[len(prompt):-1])
    assert s.labels[-1] == IGNORE_INDEX
    assert s.n_valid == 3 and s.n_prompt == len(prompt)


def test_segments_are_encoded_separately():
    # the prompt ends with "a", the response starts with "b": encoded jointly, BPE would merge "ab"
    tpl = ChatTemplate("{% for m in messages %}{% if m.role == 'user' %}x{{ m.content }}{% else %}"
                       "{{ m.content }}<|im_end|>{% endif %}{% endfor %}", stop_texts={"<|im_end|>"})
    s = encode_conversation(TOK, tpl, Pair("a", "b!").messages())
    assert TOK.MERGE not in s.inputs.tolist()
    assert s.inputs.tolist() == [ord("x"), ord("a"), ord("b"), ord("!")]
    assert s.labels.tolist() == [IGNORE_INDEX, ord("b"), ord("!"), 1001]


def test_mask_prompt_off_and_custom_ignore_index():
    s = encode_conversation(TOK, TPL, Pair("hi", "yo").messages(), EncodeOptions(mask_prompt=False))
    assert s.n_valid == len(s.labels)
    s = encode_conversation(TOK, TPL, Pair("hi", "yo").messages(), EncodeOptions(ignore_index=-1))
    assert (s.labels == -1).sum() == s.n_prompt - 1 + 1  # the prompt, and the newline after <|im_end|>


def test_system_option_adds_a_turn_only_where_there_is_none():
    plain = encode_conversation(TOK, TPL, Pair("hi", "yo").messages())
    with_sys = encode_conversation(TOK, TPL, Pair("hi", "yo").messages(), EncodeOptions(system="be brief"))
    assert with_sys.n_prompt == len(TOK.encode(_prompt("hi", "be brief"))) > plain.n_prompt
    own = [{"role": "system", "content": "S"}] + Pair("hi", "yo").messages()
    assert encode_conversation(TOK, TPL, own, EncodeOptions(system="ignored")).n_prompt == \
        len(TOK.encode(_prompt("hi", "S")))


def test_seq_max_truncates_and_oversize_prompt_is_rejected():
    n_prompt = len(TOK.encode(_prompt("hi")))
    msgs = Pair("hi", "a long response").messages()
    s = encode_conversation(TOK, TPL, msgs, EncodeOptions(seq_max=n_prompt + 1))
    assert len(s.inputs) == n_prompt + 1 and s.n_valid == 2
    # seq_max == n_prompt - 1 leaves exactly zero supervised positions
    with pytest.raises(UserError, match=r"d.jsonl:3: sample too long.*seq_max"):
        encode_conversation(TOK, TPL, msgs, EncodeOptions(seq_max=n_prompt - 1), where="d.jsonl:3")
    assert encode_conversation(TOK, TPL, msgs, EncodeOptions(seq_max=n_prompt)).n_valid == 1


def test_a_template_without_an_end_of_turn_token_is_refused():
    tpl = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", stop_texts={"<|im_end|>"})
    with pytest.raises(UserError, match=r"s:1: .*closes assistant message 1 with none"):
        encode_conversation(TOK, tpl, Pair("q", "a").messages(), where="s:1")


def test_a_prompt_the_history_does_not_repeat_is_refused():
    """A generation prompt that the rendered history does not contain (a think block pre-filled only for
    generation): the assistant span cannot be located."""
    tpl = ChatTemplate("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                       "{% if add_generation_prompt %}<|im_start|>assistant\n<think></think>{% endif %}",
                       stop_texts={"<|im_end|>"})
    with pytest.raises(UserError, match="renders the prompt of message 1 differently"):
        encode_conversation(TOK, tpl, Pair("q", "a").messages())


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
    ('{"instruction": "a", "response": "b"}\n{"instruction": "a"}\n', r"d\.jsonl:2: missing field 'response'"),
    ('{"instruction": "a", "response": 3}\n', r"d\.jsonl:1: field 'response' must be a string"),
    ('{"prompt": "a", "completion": "b"}\n', r"d\.jsonl:1: cannot tell the data format.*'completion', 'prompt'"),
    ('\n\n', r"no records found"),
])
def test_jsonl_malformed_lines_name_the_line(tmp_path, text, match):
    with pytest.raises(UserError, match=match):
        load_jsonl(_write(tmp_path, text))


def test_jsonl_missing_file(tmp_path):
    with pytest.raises(UserError, match="nope.jsonl: no such file"):
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
