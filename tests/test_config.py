"""Config: TOML + command line onto typed dataclasses, and one clear message per mistake."""

import pytest

from components.config import ConfigError, config_help, load_config, parse_args
from tests.utils import write_file


def write(tmp_path, text):
    return write_file(tmp_path, "job.toml", text)


def test_shipped_configs_parse():
    for name in ("debug_model", "qwen3_30b_a3b", "qwen3_235b_a22b", "qwen3_30b_a3b_1gpu"):
        cfg = load_config(f"train_configs/{name}.toml")
        assert cfg.model.flavor in ("debug", "qwen3_30b_a3b", "qwen3_235b_a22b")


def test_toml_then_overrides(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 1\n")
    cfg = parse_args(["--config", path, "--training.steps", "20", "--compile.enable", "--optimizer.eps=1e-6",
                      "--moe.backend", "torch"])
    assert cfg.training.steps == 20 and cfg.training.seq_len == 64
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)  # int accepted for a float
    assert cfg.compile.enable is True and cfg.optimizer.eps == 1e-6 and cfg.moe.backend == "torch"
    assert parse_args(["--config", path, "--compile.enable", "false"]).compile.enable is False


@pytest.mark.parametrize("text,pattern", [
    ("[trainig]\nsteps = 1\n", r"job.toml: unknown section \[trainig\]; allowed sections: job, model"),
    ("[training]\nstepz = 1\n", r"job.toml: unknown key 'stepz' in \[training\]; allowed keys: .*steps"),
    ("[training]\nsteps = \"ten\"\n", r"job.toml: \[training\] steps = 'ten' has the wrong type: expected int"),
    ("[training]\nsteps = 1.5\n", r"\[training\] steps = 1.5 has the wrong type: expected int"),
    ("[compile]\nenable = 1\n", r"\[compile\] enable = 1 has the wrong type: expected bool"),
    ("[training]\nsteps = 0\n", r"job.toml: \[training\] steps = 0 is out of range: must be >= 1"),
    ("[optimizer]\nbeta2 = 1.5\n", r"\[optimizer\] beta2 = 1.5 is out of range: must be <= 1"),
    ("[activation_checkpoint]\nmode = \"most\"\n", r"\[activation_checkpoint\] mode = 'most' is not allowed; "
                                                    r"choose one of 'none', 'full', 'selective'"),
    ("[moe]\nbackend = \"fast\"\n", r"\[moe\] backend = 'fast' is not a registered MoE backend; choose one of "
                                     r"grouped_mm, grouped_mm_fp8, mega.*, torch"),
    ("steps = 3\n", r"top-level key 'steps' must be a \[section\]"),
    ("[training\n", r"not valid TOML"),
    ("[metrics]\nsummary_start_step = 10\nsummary_end_step = 5\n", r"summary_end_step \(5\) must be >= "),
])
def test_bad_toml(tmp_path, text, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(write(tmp_path, text))


@pytest.mark.parametrize("args,pattern", [
    (["--training.stepz", "3"], r"command line: unknown key 'stepz' in \[training\]"),
    (["--trainig.steps", "3"], r"command line: unknown section in '--trainig.steps'"),
    (["--training.steps", "x"], r"command line: --training.steps 'x' is not a valid int"),
    (["--training.steps"], r"--training.steps needs a value"),
    (["--training.steps", "-2"], r"command line: --training.steps -2 is out of range: must be >= 1"),
    (["--moe.backend", "nope"], r"^command line: --moe.backend 'nope' is not a registered MoE backend"),
    (["--config", "train_configs/debug_model.toml", "--moe.backend", "nope"],
     r"^command line: --moe.backend 'nope' is not a registered"),
    (["--config", "train_configs/debug_model.toml", "--activation_checkpoint.keep", "attention"],
     r"^command line and train_configs/debug_model.toml: \[activation_checkpoint\] keep = 'attention' keeps"),
    (["--activation_checkpoint.mode", "banana"], r"command line: --activation_checkpoint.mode 'banana' is not allowed"),
    (["steps"], r"unexpected argument 'steps'"),
    (["--config", "nope.toml"], r"config file 'nope.toml' does not exist"),
])
def test_bad_command_line(args, pattern):
    with pytest.raises(ConfigError, match=pattern):
        parse_args(args)


def test_help_lists_sections_fields_and_defaults(capsys):
    assert parse_args(["--help"]) is None
    out = capsys.readouterr().out
    for section in ("[job]", "[model]", "[moe]", "[training]", "[optimizer]", "[lr_scheduler]", "[parallelism]",
                    "[activation_checkpoint]", "[compile]", "[precision]", "[checkpoint]", "[metrics]"):
        assert section in out
    assert "--training.steps int = 10000" in out and "--moe.backend str = 'grouped_mm'" in out
    assert out == config_help() + "\n"
    # Every field of every section with its default, read off the dataclasses rather than the help code.
    import dataclasses

    from components.config import JobConfig

    defaults = JobConfig()
    for section in dataclasses.fields(JobConfig):
        for f in dataclasses.fields(getattr(defaults, section.name)):
            value = getattr(getattr(defaults, section.name), f.name)
            assert f"  --{section.name}.{f.name} {type(value).__name__} = {value!r}" in out, (section.name, f.name)


def test_docs_config_reference_is_current():
    from pathlib import Path

    from components.config import config_markdown

    page = (Path(__file__).resolve().parent.parent / "docs" / "config.md").read_text()
    block = page.split("<!-- config-reference -->\n", 1)[1].split("<!-- /config-reference -->", 1)[0]
    assert block.strip() == config_markdown().strip(), "regenerate with: python scripts/regen_config_reference.py"


def test_moved_key_names_its_new_section(tmp_path):
    """A key that moved sections is refused with its new place, in the TOML file and on the command line;
    at the new place it is read."""
    path = write_file(tmp_path, "old.toml", "[parallelism]\nexpert_parallel_chunks = 2\n")
    with pytest.raises(ConfigError, match=r"\[parallelism\] expert_parallel_chunks moved to \[experimental\]"):
        load_config(str(path))
    with pytest.raises(ConfigError, match=r"--experimental\.expert_parallel_chunks"):
        parse_args(["--config", "train_configs/debug_model.toml", "--parallelism.expert_parallel_chunks", "2"])
    cfg = parse_args(["--config", "train_configs/debug_model.toml", "--experimental.expert_parallel_chunks", "3"])
    assert cfg.experimental.expert_parallel_chunks == 3 and cfg.parallelism.expert_capacity_factor == 2.0


def test_relative_paths_resolve_beside_the_config(tmp_path, monkeypatch):
    """From another working directory: the shipped config's assets/... are found in the project
    folder, a path beside a config file there, one in the working directory first; a command-line
    path is relative to the working directory only; a path found nowhere names every place tried."""
    from components.config import PROJECT_DIR

    tmp_path = tmp_path.resolve()
    shipped = str(PROJECT_DIR / "train_configs" / "debug_model.toml")
    cwd, conf = tmp_path / "cwd", tmp_path / "conf"
    (conf / "data").mkdir(parents=True)
    (conf / "data" / "a.txt").write_text("a document\n")
    cwd.mkdir()
    monkeypatch.chdir(cwd)

    cfg = load_config(shipped)
    assert cfg.model.tokenizer_path == str(PROJECT_DIR / "assets" / "tokenizer" / "tokenizer.model")
    assert cfg.training.dataset_path == str(PROJECT_DIR / "assets" / "data" / "stories")
    job = write_file(conf, "job.toml", '[training]\ndataset_path = "data"\n[checkpoint]\ninitial_load_path = "hf"\n')
    cfg = load_config(job)
    assert cfg.training.dataset_path == str(conf / "data")
    assert cfg.checkpoint.initial_load_path == str(cwd / "hf")  # read (and reported) only by a fresh run
    (cwd / "data").mkdir()
    assert load_config(job).training.dataset_path == "data"  # the working directory's, as written

    with pytest.raises(ConfigError, match=rf"^command line: --training.dataset_path 'assets/data/stories' not "
                                          rf"found \({cwd}/assets/data/stories\)$"):
        parse_args(["--config", shipped, "--training.dataset_path", "assets/data/stories"])
    bad = write_file(conf, "bad.toml", '[model]\ntokenizer_path = "tok/missing.model"\n')
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert str(e.value) == (f"{bad}: [model] tokenizer_path = 'tok/missing.model' not found (tried "
                            f"{cwd}/tok/missing.model, {conf}/tok/missing.model, {PROJECT_DIR}/tok/missing.model)")
