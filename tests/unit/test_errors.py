"""gradwire's errors cross process boundaries (Ray, multiprocessing) whole: class, message and context."""

import pickle

import pytest

from gradwire.errors import GradwireTimeout, JobAborted, TensorMismatch, WorkerLost


@pytest.mark.parametrize(
    "error",
    [
        WorkerLost("job aborted: lost worker 1", lost_rank=1, rank=0),
        JobAborted("lost the scheduler", rank=2),
        TensorMismatch("declared differently", tensor="w", rank=1),
        GradwireTimeout("did not complete in 30s", tensor="g"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_pickle_with_their_context(error):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error) and copy.context == error.context
    assert getattr(copy, "lost_rank", None) == getattr(error, "lost_rank", None)
