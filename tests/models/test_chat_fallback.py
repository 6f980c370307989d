"""A GGUF without tokenizer.chat_template gets its family's own turn format (said once on stderr):
ChatML for qwen, Llama 3's for a llama whose vocabulary has its header tokens, Gemma's for gemma3;
`--chat-template NAME|FILE` overrides the file's or the family's template for any model."""
import json
import os
from types import SimpleNamespace

import pytest

from pipeline.errors import UserError
from pipeline.llm import chat
from pipeline.llm.chat import ChatTemplate, render_chatml

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Ahoy!"}, {"role": "user", "content": "Again"}]
GEMMA_VOCAB = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "a", "b"]
LLAMA3_VOCAB = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "a"]


def _gguf(arch, tokens, path, template=None, bos=None, eos=None):
    md = {"tokenizer.ggml.tokens": tokens}
    if template is not None:
        md["tokenizer.chat_template"] = template
    if bos is not None:
        md["tokenizer.ggml.bos_token_id"], md["tokenizer.ggml.eos_token_id"] = bos, eos
    return SimpleNamespace(metadata=md, path=path, architecture=arch)


def test_gemma3_without_a_template_uses_gemmas_turns_and_stops_at_end_of_turn(tmp_path, capsys):
    gg = _gguf("gemma3", GEMMA_VOCAB, tmp_path / "g.gguf", bos=2, eos=1)
    t = ChatTemplate.from_gguf(gg)
    text = t.render(MESSAGES)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\nAhoy!"
                    "<end_of_turn>\n<start_of_turn>user\nAgain<end_of_turn>\n<start_of_turn>model\n")
    assert GEMMA_VOCAB.index("<end_of_turn>") in t.stop_ids and "<end_of_turn>" in t.stop_texts
    ChatTemplate.from_gguf(gg)  # the same file again: not said twice
    err = capsys.readouterr().err
    assert err.count("has no tokenizer.chat_template; using the gemma3 turn format 'gemma'") == 1


@pytest.mark.parametrize("arch,tokens,want", [
    ("qwen3", ["<|im_start|>", "<|im_end|>", "a"], "chatml"),
    ("qwen2", ["<|im_start|>", "<|im_end|>", "a"], "chatml"),
    ("llama", LLAMA3_VOCAB, "llama3"),
    ("llama", ["<unk>", "<s>", "</s>", "a"], "chatml"),  # a Llama 2 / TinyLlama vocabulary has no header tokens
    ("gemma3", ["<unk>", "a"], "chatml"),
])
def test_each_family_falls_back_to_its_own_format(tmp_path, capsys, arch, tokens, want):
    t = ChatTemplate.from_gguf(_gguf(arch, tokens, tmp_path / f"{arch}-{want}.gguf"))
    assert f"turn format '{want}'" in capsys.readouterr().err
    if want == "chatml":
        assert t.render(MESSAGES) == render_chatml(MESSAGES)
    else:
        assert t.render(MESSAGES[1:2]) == ("<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
                                           "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_chat_template_overrides_the_files_by_name_or_file(tmp_path, capsys):
    gg = _gguf("qwen3", GEMMA_VOCAB, tmp_path / "q.gguf", template="{{ 'FILE TEMPLATE' }}")
    assert ChatTemplate.from_gguf(gg).render(MESSAGES) == "FILE TEMPLATE"
    assert ChatTemplate.from_gguf(gg, "gemma").render(MESSAGES[1:2]).startswith("<start_of_turn>user\nHi there")
    assert ChatTemplate.from_gguf(gg, "chatml").render(MESSAGES) == render_chatml(MESSAGES)
    own = tmp_path / "mine.jinja"
    own.write_text("{% for m in messages %}[{{ m['role'] }}]{% endfor %}", encoding="utf-8")
    assert ChatTemplate.from_gguf(gg, str(own)).render(MESSAGES, add_generation_prompt=False) == \
        "[system][user][assistant][user]"
    assert capsys.readouterr().err == ""  # an override or the file's own template is not a fallback


def test_a_bad_chat_template_argument_is_one_named_error(tmp_path):
    gg = _gguf("qwen3", GEMMA_VOCAB, tmp_path / "q.gguf")
    with pytest.raises(UserError, match=r"--chat-template nope: neither a format name \(chatml, llama3, gemma\)"):
        ChatTemplate.from_gguf(gg, "nope")
    binary = tmp_path / "bin.jinja"
    binary.write_bytes(b"\xff\xfe{{")
    with pytest.raises(UserError, match=r"--chat-template .*bin.jinja: not UTF-8 text"):
        ChatTemplate.from_gguf(gg, str(binary))
    big = tmp_path / "big.jinja"
    big.write_bytes(b" " * (chat.MAX_TEMPLATE_FILE_BYTES + 1))
    with pytest.raises(UserError, match="larger than"):
        ChatTemplate.from_gguf(gg, str(big))


@pytest.mark.parametrize("command", ["generate", "finetune"])
def test_the_commands_take_chat_template(tmp_path, capsys, command):
    from pipeline.cli import main
    model = os.path.join(os.path.dirname(__file__), "..", "fixtures", "qwen3-mini-f32.gguf")
    if command == "generate":
        argv = ["generate", "--model", model, "--prompt", "Hi", "--chat", "--max-tokens", "2",
                "--chat-template", "nope"]
    else:
        argv = ["finetune", "--model", model, "--steps", "1", "--json", "--chat-template", "nope",
                "--save", str(tmp_path / "run")]
    assert main(argv) != 0
    assert "--chat-template nope: neither a format name" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    if command == "finetune":  # a valid override trains
        assert main(argv[:-3] + ["chatml", "--save", str(tmp_path / "ok")]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["final_loss"] > 0
