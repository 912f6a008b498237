"""An extension author's mistakes, each one line (exit 2) naming what to fix, never a traceback from inside
accelbatch or torch: a GeneratorAgent core that breaks the encode/decode contract, a `torch:` model paired with
a text task (and a text model with a `torch:` task), a misspelt class in `-m module:Class`; and a plain Agent's
save(path)/load(path) pair, which `eval -mf` loads as training saved it."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import accelbatch as ab
from accelbatch.cli import main
from accelbatch.generation import EOS, ByteVocab, CoreError, GeneratorModel
from accelbatch.models.generator import GeneratorAgent
from accelbatch.names import UnknownNameError, import_object
from accelbatch.opts import OptionError

ME = "test_extension_errors"
GEN_RUN = ["-t", "reverse:80", "-bs", "4", "-esz", "16", "--no-progress", "--label-truncate", "8"]
TRAIN = ["-tstep", "2", "-veps", "-1", "--eval-splits", ""]


class GRUCore(nn.Module):
    """The README's working core: a GRU encoder's mean state starts a GRU decoder (batch first)."""

    def __init__(self, vocab: int, dim: int, classes: int | None = None, time_major: bool = False):
        super().__init__()
        self.time_major = time_major
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.enc = nn.GRU(dim, dim, batch_first=True)
        self.dec = nn.GRU(dim, dim, batch_first=not time_major)
        self.out = nn.Linear(dim, classes or vocab)

    def encode(self, t: torch.Tensor) -> torch.Tensor:
        m = (t != 0).float().unsqueeze(-1)
        h, _ = self.enc(self.emb(t))
        return (h * m).sum(1) / m.sum(1).clamp_min(1)

    def decode(self, s: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        x = self.emb(p).transpose(0, 1) if self.time_major else self.emb(p)  # time-major: [T, rows, dim]
        y, _ = self.dec(x, s.unsqueeze(0).contiguous())
        return self.out(y)


class LastOnlyCore(GRUCore):
    def decode(self, s, p):
        return super().decode(s, p)[:, -1]  # [rows, vocab]: the last position's logits only


class NoEncodeCore(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(4, ByteVocab.size)

    def decode(self, s, p):
        return self.out(torch.zeros(*p.shape, 4))


class GRUGenerator(GeneratorAgent):
    def build_core(self):
        return GRUCore(self.vocab.size, self.opts.embedding_size)


class HundredClasses(GeneratorAgent):
    def build_core(self):
        return GRUCore(self.vocab.size, self.opts.embedding_size, classes=100)


class TimeMajor(GeneratorAgent):
    def build_core(self):
        return GRUCore(self.vocab.size, self.opts.embedding_size, time_major=True)


class LastOnly(GeneratorAgent):
    def build_core(self):
        return LastOnlyCore(self.vocab.size, self.opts.embedding_size)


class NoEncode(GeneratorAgent):
    def build_core(self):
        return NoEncodeCore()


def _one_line_error(capsys, argv: list[str]) -> str:
    """The run of ``argv`` ends with exit code 2 and one line on stderr: that line."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("verb", ["train", "eval"])
def test_a_core_without_encode_is_refused_naming_build_core(capsys, verb):
    err = _one_line_error(capsys, [verb, *GEN_RUN, "-m", f"{ME}:NoEncode", *(TRAIN if verb == "train" else [])])
    assert "NoEncode.build_core(): the core is a NoEncodeCore, which has no encode(); a core is an nn.Module with " \
           "encode(text_vec [rows, S]) -> state and decode(state, prefix [rows, T]) -> logits [rows, T, vocab.size]" \
           in err


def test_build_core_returning_no_module_is_refused():
    with pytest.raises(CoreError, match=r"^GeneratorModel\(core\): the core is a function, not an nn.Module; a core"):
        GeneratorModel(lambda text: text, max_len=4)  # type: ignore[arg-type]


# the first decode is the teacher-forced loss on labels of 8 tokens (--label-truncate 8, padded to 8): [4, 8]
@pytest.mark.parametrize("verb", ["train", "eval"])
@pytest.mark.parametrize("model, got, says", [
    ("LastOnly", [4, ByteVocab.size], "the logits of every prefix position are needed"),
    ("HundredClasses", [4, 8, 100], f"its output layer must have vocab.size = {ByteVocab.size} classes"),
    ("TimeMajor", [8, 4, ByteVocab.size], "rows come first: a time-major [T, rows, vocab] output"),
])
def test_logits_of_another_shape_are_refused_naming_decode_and_the_shapes(capsys, verb, model, got, says):
    err = _one_line_error(capsys, [verb, *GEN_RUN, "-m", f"{ME}:{model}", *(TRAIN if verb == "train" else [])])
    assert (f"{model}.build_core(): its decode(state, prefix [4, 8]) returned logits of shape {got}, expected "
            f"[4, 8, {ByteVocab.size}] ([rows, T, vocab.size]); {says}") in err


@pytest.mark.parametrize("inference", ["greedy", "beam"])
def test_logits_of_another_shape_are_refused_when_generating(inference):
    """Generation's decode calls are checked too (a model evaluated without labels decodes first there)."""
    torch.manual_seed(0)
    model = GeneratorModel(LastOnlyCore(ByteVocab.size, 8), max_len=3, inference=inference, beam_size=2,
                           vocab_size=ByteVocab.size, source="LastOnly.build_core()").eval()
    rows = 2 * (2 if inference == "beam" else 1)
    with pytest.raises(CoreError, match=rf"decode\(state, prefix \[{rows}, 1\]\) returned logits of shape "
                                        rf"\[{rows}, {ByteVocab.size}\], expected \[{rows}, 1, {ByteVocab.size}\]"):
        model({"text_vec": torch.tensor([[5, 6], [7, 0]])})


def test_the_readme_core_trains_and_decodes_greedy_and_beam(tmp_path, capsys):
    """The working core trains; its beam search of size 1 gives greedy's replies (both decode every step)."""
    path = str(tmp_path / "gru.pt")
    assert main(["train", *GEN_RUN, "-m", f"{ME}:GRUGenerator", "-mf", path, *TRAIN]) == 0
    agent = GRUGenerator(ab.Opts(model_file=path, embedding_size=16, label_truncate=8))
    text = torch.tensor([[ByteVocab.size - 1 - i for i in range(6)], [40, 41, 42, 0, 0, 0]])
    model = agent.model.eval()
    greedy = GeneratorModel(model.core, 8, vocab_size=ByteVocab.size).eval()({"text_vec": text})["preds"]
    beam1 = GeneratorModel(model.core, 8, "beam", 1, vocab_size=ByteVocab.size).eval()({"text_vec": text})["preds"]
    assert torch.equal(greedy, beam1)
    # by hand: greedy's first token is the arg max of the decoder's first position after BOS
    first = model.core.decode(model.core.encode(text), torch.full((2, 1), 1))[:, 0]
    first[:, :2] = float("-inf")  # PAD and BOS are never generated
    assert torch.equal(greedy[:, 0], first.argmax(-1))
    assert main(["eval", "-mf", path, "-t", "reverse:80", "--inference", "beam", "--beam-size", "3",
                 "--no-progress"]) == 0
    assert "valid" in capsys.readouterr().out


# -- a torch: model reads a torch: task's items; no other model does, and it reads nothing else ------------------

TORCH_TASK, TORCH_MODEL = "torch:torch_task:make_dataset", "torch:torch_task:Classifier"
READS_ITEMS = f"-m {TORCH_MODEL} reads the items of a -t torch:pkg.mod:make_dataset task (your torch Dataset)"


class TextModel(nn.Module):
    def forward(self, batch):
        return {"loss": batch["x"].float().sum() * 0}


class TextAgent(ab.TorchAgent):
    """A user's text TorchAgent: it reads the messages' 'text'."""

    def build_model(self):
        return TextModel()

    def vectorize(self, obs):
        obs["x"] = len(obs.get("text") or "")
        return obs

    def batchify(self, observations):
        return {"x": torch.tensor([obs["x"] for obs in observations])}

    def replies(self, outputs, observations):
        return [{"text": "x"} for _ in observations]


class TextTeacher(ab.FixedTeacher):
    """A user's teacher of text messages (-t module:Class), which only the first batch tells from an item task."""

    def setup_data(self):
        return [[{"text": f"question {i}", "labels": ["yes"], "episode_done": True}] for i in range(8)]


@pytest.mark.parametrize("task", ["babi:1", f"{TORCH_TASK},babi:1"])
def test_a_torch_model_on_a_text_task_is_refused_before_training(tmp_path, capsys, task):
    report = tmp_path / "r.json"
    err = _one_line_error(capsys, ["train", "-t", task, "-m", TORCH_MODEL, "-bs", "4", *TRAIN,
                                   "--no-progress", "--report-json", str(report)])
    assert f"{READS_ITEMS}; -t babi:1 gives text messages: give -t your Dataset's factory" in err
    assert not report.exists()


def test_eval_of_a_torch_model_on_a_text_task_is_refused(tmp_path, capsys):
    path = str(tmp_path / "t.pt")
    assert main(["train", "-t", TORCH_TASK, "-m", TORCH_MODEL, "-bs", "4", *TRAIN, "--no-progress", "-mf", path]) == 0
    capsys.readouterr()
    assert main(["eval", "-mf", path, "-t", "babi:1", "--no-progress"]) == 2
    noted, error = capsys.readouterr().err.splitlines()  # the model file's options, said first; then the error
    assert "was trained with -m torch:torch_task:Classifier" in noted
    assert error.startswith(f"accelbatch: error: {READS_ITEMS}; -t babi:1 gives text messages")


def test_a_torch_model_on_a_users_text_teacher_is_refused_at_the_first_batch(capsys):
    err = _one_line_error(capsys, ["train", "-t", f"{ME}:TextTeacher", "-m", TORCH_MODEL, "-bs", "4", *TRAIN,
                                   "--no-progress"])
    assert (f"{READS_ITEMS}; -t {ME}:TextTeacher gives text messages (this one has no item: 'question ") in err


@pytest.mark.parametrize("model", [f"{ME}:TextAgent", "repeat_label"])
def test_a_text_model_on_a_torch_task_is_refused_naming_torch_models(tmp_path, capsys, model):
    report = tmp_path / "r.json"
    err = _one_line_error(capsys, ["train", "-t", TORCH_TASK, "-m", model, "-bs", "4", *TRAIN, "--no-progress",
                                   "--report-json", str(report)])
    assert (f"-t {TORCH_TASK} gives items (tensors, no 'text'), which -m {model} cannot read: a torch Dataset task "
            "is trained by your model, -m torch:pkg.mod:Model") in err
    assert not report.exists()


def test_a_text_agent_class_on_a_torch_task_is_named_by_its_class():
    with pytest.raises(OptionError, match=rf"^-t {TORCH_TASK} gives items \(tensors, no 'text'\), which "
                                             "TextAgent cannot read"):
        ab.create_world(ab.Opts(task=TORCH_TASK, batchsize=4), agent=TextAgent)


# -- -m module:Class with a misspelt class -------------------------------------------------------------------------

def test_a_misspelt_class_gets_a_did_you_mean_over_the_modules_classes():
    with pytest.raises(UnknownNameError, match=r"^model 'test_extension_errors:GRUGenerater': module "
                                               r"'test_extension_errors' has no 'GRUGenerater' \(did you mean "
                                               r"'GRUGenerator'( or '\w+'){0,2}\?\)$"):  # the closest first
        import_object(f"{ME}:GRUGenerater", "model", [])
    with pytest.raises(UnknownNameError, match=r"has no 'textagent' \(did you mean 'TextAgent'"):
        import_object(f"{ME}:textagent", "model", [])  # case aside


def test_a_name_like_none_lists_the_classes_and_functions_the_module_defines(capsys):
    err = _one_line_error(capsys, ["train", "-m", "torch_task:Zzzzzz", "-tstep", "1", "--no-progress"])
    assert "model 'torch_task:Zzzzzz': module 'torch_task' has no 'Zzzzzz' (its classes and functions: " in err
    listed = err.split("its classes and functions: ")[1]
    assert "Classifier" in listed and "Dataset" not in listed  # its own, not what it imported


# -- a plain Agent's save(path) and load(path) ---------------------------------------------------------------------

class Memorizer(ab.Agent):
    """Answers a question with the label it was trained on for it; save/load write and read that memory."""

    def __init__(self, opts, shared=None):
        super().__init__(opts, shared)
        self.memory = shared["memory"] if shared else {}
        self.loads = shared["loads"] if shared else []

    def share(self):
        return {**super().share(), "memory": self.memory, "loads": self.loads}

    def act(self):
        obs = self.observation or {}
        if "text" not in obs:
            return {}
        question = obs["text"].split("\n")[-1]
        if obs.get("labels"):
            self.memory[question] = obs["labels"][0]
        return {"text": self.memory.get(question, "?")}

    def save(self, path):
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.memory, handle)

    def load(self, path):
        self.loads.append(path)  # not idempotent: a second call would show
        with open(path, encoding="utf-8") as handle:
            self.memory.update(json.load(handle))


class InheritedLoad(Memorizer):
    """Its load is its parent's."""


class ParlAIStyle(Memorizer):
    """Loads -mf in __init__ when it exists, as ParlAI's agents do."""

    def __init__(self, opts, shared=None):
        super().__init__(opts, shared)
        if shared is None and opts.model_file and __import__("os").path.isfile(opts.model_file):
            self.load(opts.model_file)


@pytest.mark.parametrize("model", ["Memorizer", "InheritedLoad", "ParlAIStyle"])
def test_eval_loads_a_plain_agent_saved_by_training_once(tmp_path, capsys, model):
    """Training scores the memory it holds; eval -mf of the saved file scores the same memory, loaded once."""
    path, report = str(tmp_path / "memo.json"), tmp_path / "r.json"
    assert main(["train", "-t", "babi:1", "-m", f"{ME}:{model}", "-mf", path, "-ne", "1", "--no-progress",
                 "--eval-splits", "valid", "--report-json", str(tmp_path / "train.json")]) == 0
    trained = json.loads((tmp_path / "train.json").read_text())["valid"]["accuracy"]
    assert trained > 0.1  # the questions of valid that training met (old eval: 0.0, an empty memory)
    assert main(["eval", "-mf", path, "--no-progress", "--report-json", str(report)]) == 0
    assert json.loads(report.read_text())["valid"]["accuracy"] == trained
    agent = ab.create_world(ab.Opts(task="babi:1", model_file=path, datatype="valid"),
                            agent=globals()[model]).get_model_agent()
    assert agent.loads == [path] and len(agent.memory) == len(json.load(open(path, encoding="utf-8")))
    assert "load" not in vars(InheritedLoad) and vars(Memorizer)["load"].__qualname__ == "Memorizer.load"


class Forgetter(Memorizer):
    """Forgets everything once it has trained on 600 turns and learns nothing more: with -veps 0.1 its best
    validation is the first, after 500 of babi:1's 5,000 training turns."""

    def act(self):
        obs = self.observation or {}
        if obs.get("labels"):
            self.trained = getattr(self, "trained", 0) + 1
            if self.trained > 600:
                self.memory.clear()
                return {"text": "?"}
        return super().act()


def test_training_s_final_evaluation_scores_the_best_saved_plain_agent(tmp_path):
    """-veps 0.1: the first validation (after 500 turns) is the best and is saved; the agent then forgets. The
    final valid scores the file's memory (reloaded as a TorchAgent's best weights are), not the empty one."""
    path, report = str(tmp_path / "memo.json"), tmp_path / "r.json"
    assert main(["train", "-t", "babi:1", "-m", f"{ME}:Forgetter", "-mf", path, "-ne", "1", "-veps", "0.1",
                 "--no-progress", "--eval-splits", "valid", "--report-json", str(report)]) == 0
    saved = json.load(open(path, encoding="utf-8"))
    assert 0 < len(saved) <= 600  # the memory of the first validation, kept as the best
    assert main(["eval", "-mf", path, "--no-progress", "--report-json", str(tmp_path / "e.json")]) == 0
    best = json.loads((tmp_path / "e.json").read_text())["valid"]["accuracy"]
    assert best > 0.1 and json.loads(report.read_text())["valid"]["accuracy"] == best


class SaveOnly(ab.Agent):
    """Writes its memory with save(path) and has no load(path)."""

    def act(self):
        return {"text": "?"}

    def save(self, path):
        with open(path, "w", encoding="utf-8") as handle:
            handle.write("{}")


def test_eval_of_a_plain_agent_that_cannot_load_its_file_says_so(tmp_path, capsys):
    """Its eval -mf scored an agent as built, silently; one line names the missing load(path) (once, and not
    for an agent that has one)."""
    path = str(tmp_path / "m.json")
    assert main(["train", "-t", "babi:1", "-m", f"{ME}:SaveOnly", "-mf", path, "-tstep", "1", "--no-progress",
                 "--eval-splits", ""]) == 0
    assert "no load(path)" not in capsys.readouterr().err  # no file yet: nothing to read
    assert main(["eval", "-mf", path, "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert err.count(f"accelbatch: -mf {path}: SaveOnly has no load(path), so it runs as built, without what the "
                     "file holds; give it a load(path)") == 1
    assert main(["train", "-t", "babi:1", "-m", f"{ME}:Memorizer", "-mf", path, "-tstep", "1", "--no-progress",
                 "--eval-splits", ""]) == 0
    assert "no load(path)" not in capsys.readouterr().err


def test_a_plain_agent_without_a_model_file_is_not_loaded(tmp_path):
    agent = ab.create_world(ab.Opts(task="babi:1", model_file=str(tmp_path / "none.json"), datatype="valid"),
                            agent=Memorizer).get_model_agent()
    assert agent.loads == [] and agent.memory == {}


class OneRowTimeMajor(nn.Module):
    """[T, rows, vocab] logits: with one row, the first step's [1, 1, vocab] looks right; the second's does not."""

    def encode(self, text):
        return text

    def decode(self, text, prefix):
        return torch.zeros(prefix.shape[1], prefix.shape[0], ByteVocab.size)


def test_a_time_major_core_is_refused_at_the_second_step_of_a_one_row_reply():
    """interactive decodes one row without labels: the loss, which would tell, is not computed."""
    model = GeneratorModel(OneRowTimeMajor(), max_len=4, vocab_size=ByteVocab.size, source="X.build_core()").eval()
    with pytest.raises(CoreError, match=r"prefix \[1, 2\]\) returned logits of shape \[2, 1, 259\], expected "
                                        r"\[1, 2, 259\] .*rows come first"):
        model({"text_vec": torch.tensor([[5, 6]])})


def test_a_decode_returning_a_tuple_is_refused():
    class Pair(GRUCore):
        def decode(self, s, p):
            return super().decode(s, p), s  # (logits, hidden), as an RNN's forward returns

    model = GeneratorModel(Pair(ByteVocab.size, 8), max_len=4, vocab_size=ByteVocab.size, source="P.build_core()")
    with pytest.raises(CoreError, match=r"^P.build_core\(\): its decode\(state, prefix \[1, 2\]\) returned tuple, "
                                        r"expected \[1, 2, 259\] .*; return the logits tensor itself$"):
        model({"text_vec": torch.tensor([[5, 6]]), "label_vec": torch.tensor([[7, EOS]])})
