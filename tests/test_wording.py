"""Counts in messages agree with their nouns ("1 micro-batch", not "1 micro-batches")."""

from lnstrain.wording import counted


def test_a_count_takes_the_noun_in_its_number():
    assert counted(1, "micro-batch", "micro-batches") == "1 micro-batch"
    assert counted(4, "micro-batch", "micro-batches") == "4 micro-batches"
    assert counted(0, "distinct sample") == "0 distinct samples"
    assert counted(1, "document") == "1 document" and counted(2048, "token") == "2,048 tokens"
    assert counted(2, "batch") == "2 batches" and counted(3, "pass") == "3 passes"
