"""SciQ as a fedlora task: one declaration. Its hub records become LLM-Adapters questions
("Answer1: ... Answer4: ..."), its lm-eval request is arc's "Question: ...\nAnswer:" (the
support passage left out, as fedlora's BoolQ leaves out its passage), its files live in
<data_dir>/SciQ/{train,test}.json."""

from fedlora.llm.task_registry import QUESTION_LEAD_IN, question_answer, register_task
from fedlora.llm.task_types import HubSource, TaskSpec


def read_sciq(rec):
    """A hub record -> (question, options, index of the correct one)."""
    options = [rec["distractor1"], rec["distractor2"], rec["distractor3"], rec["correct_answer"]]
    return rec["question"], options, 3


register_task(
    TaskSpec(
        name="sciq",
        folder="SciQ",
        lm_eval="sciq",
        lead_in=QUESTION_LEAD_IN,
        option_word="answer",
        request=question_answer,
        hub=HubSource("allenai/sciq", None, {"train": "train", "test": "test"}, read_sciq),
    )
)
