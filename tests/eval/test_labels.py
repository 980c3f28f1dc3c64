"""`--labels N|P%` (`unison.eval.labels`): parsing, the count of a share, and the class-balanced draw it feeds."""

import pytest
import torch

from unison.data.subsets import balanced_subset
from unison.errors import ConfigError
from unison.eval.labels import LabelBudget


@pytest.mark.parametrize("text, total, expected", [("all", 45_000, 45_000), ("100%", 10, 10), ("10%", 45_000, 4_500),
                                                   ("1%", 45_000, 450), ("0.5%", 1_438, 7), ("4500", 45_000, 4_500),
                                                   ("0.001%", 100, 1)])
def test_a_budget_is_a_count_or_a_share_of_the_data(text, total, expected):
    budget = LabelBudget.parse(text)
    assert budget.count(total) == expected
    assert budget.everything == (expected == total and "%" not in text.replace("100%", "") and not text.isdigit())


@pytest.mark.parametrize("text", ["0", "-5", "150%", "0%", "ten", "5 %", "1e3", "", True, 3.5])
def test_a_bad_budget_is_one_line_naming_it(text):
    with pytest.raises(ConfigError, match="--labels"):
        LabelBudget.parse(text)


def test_more_images_than_the_data_has_is_refused():
    with pytest.raises(ConfigError, match="more images than --data has"):
        LabelBudget.parse("501").count(500)


def test_the_draw_is_class_balanced_and_a_function_of_the_seed():
    labels = torch.arange(10).repeat_interleave(4500)[torch.randperm(45_000, generator=torch.Generator().manual_seed(1))]
    n = LabelBudget.parse("1%").count(len(labels))
    a, b, c = (balanced_subset(labels, n, seed) for seed in (0, 0, 1))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.bincount(labels[a], minlength=10).tolist() == [45] * 10
    assert torch.bincount(labels[c], minlength=10).tolist() == [45] * 10
