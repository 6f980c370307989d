"""The built-in corpus is a function of the Python build only, not of what the calling process patched."""
import threading

from pipeline.jobs import corpus


def test_a_patched_stdlib_member_does_not_change_the_corpus(monkeypatch):
    corpus.corpus_bytes.cache_clear()
    corpus.clean_docstrings.cache_clear()
    before = corpus.corpus_bytes()

    def hook(args):  # no docstring: the member's text would vanish from an in-process reading
        pass
    monkeypatch.setattr(threading, "excepthook", hook)
    in_process = [d for d in corpus._docstrings("threading") if d.startswith("threading.excepthook")]
    corpus.corpus_bytes.cache_clear()
    corpus.clean_docstrings.cache_clear()
    assert corpus.corpus_bytes() == before
    assert b"threading.excepthook" in before and not in_process
