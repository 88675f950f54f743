"""diloco_ray.runtime.remotes: one Ray actor class (or remote function) per target and
options, so a class is exported to the cluster once per process, not once per actor."""

from diloco_ray.runtime import remotes


class Board:
    def ping(self):
        return 1


class FakeBoard(Board):
    pass


def work(x):
    return x


def test_the_same_target_and_options_give_the_same_class():
    made = remotes.remote(Board, concurrency_groups={"control": 1})  # a dict option: unhashable
    assert remotes.remote(Board, concurrency_groups={"control": 1}) is made
    assert remotes.remote(work, num_cpus=0, max_calls=1) is remotes.remote(work, max_calls=1, num_cpus=0)


def test_another_class_or_other_options_give_another():
    made = remotes.remote(Board)
    assert remotes.remote(FakeBoard) is not made  # a test's fake is its own class
    assert remotes.remote(Board, num_cpus=0) is not made
    assert remotes.remote(Board, concurrency_groups={"control": 2}) is not remotes.remote(
        Board, concurrency_groups={"control": 1}
    )
    assert remotes.remote(Board, num_cpus=0).options(num_cpus=1) is not remotes.remote(Board, num_cpus=0)
