"""The TOML job file (`fucina launch JOB --spec FILE`): hostile input is one UserError naming the file."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hypothesis_profiles import QUICK
from pipeline.errors import UserError
from pipeline.jobs.lm import LMSpec
from pipeline.jobs.spec import MAX_JOB_FILE_BYTES, load_toml


@pytest.mark.parametrize("content,reason", [
    (b"a = " + b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),  # RecursionError in tomllib before
    (b"steps = \xff\xfe", "not UTF-8"),
    (b"steps = [1", "not valid TOML"),
    (b"x" * (MAX_JOB_FILE_BYTES + 1), "is refused"),
])
def test_hostile_job_files_are_one_error(tmp_path, content, reason):
    path = tmp_path / "job.toml"
    path.write_bytes(content)
    with pytest.raises(UserError, match=reason) as e:
        load_toml(str(path), LMSpec)
    assert str(path) in str(e.value)


def test_a_directory_is_one_error(tmp_path):
    with pytest.raises(UserError, match="cannot read the job file"):
        load_toml(str(tmp_path), LMSpec)


@QUICK
@given(st.binary(max_size=400))
def test_random_job_files_raise_only_user_errors(tmp_path_factory, content):
    path = tmp_path_factory.mktemp("job") / "job.toml"
    path.write_bytes(content)
    try:
        load_toml(str(path), LMSpec)
    except UserError:
        pass
