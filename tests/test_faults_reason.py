"""``faults.reason``: the one-line report of an uncaught error names the torus error inside a TensorFlow op."""
from torus import faults

TF_TEXT = """Graph execution error:

Detected at node torus_bucket0_start defined at (most recent call last):
  File "x.py", line 10, in <module>

Traceback (most recent call last):
  File "buckets.py", line 185, in _agree
    raise MismatchError(
torus.errors.MismatchError: allreduce of gradient buckets on rank 1: rank 1 bucket the gradients differently

\t [[{{node torus_bucket0_start}}]] [Op:__inference_one_step_on_data_404]"""


def test_a_tensorflow_wrapped_error_is_named_by_the_error_inside():
    wrapper = type("InvalidArgumentError", (Exception,), {"__module__": "tensorflow.python.framework.errors_impl"})
    name, message = faults.reason(wrapper, wrapper(TF_TEXT))
    assert name == "MismatchError (in a TensorFlow op: InvalidArgumentError)"
    assert message == "allreduce of gradient buckets on rank 1: rank 1 bucket the gradients differently"


def test_other_errors_keep_their_name_and_whole_message():
    exc = RuntimeError("rank 3 fails\nsecond line")
    assert faults.reason(RuntimeError, exc) == ("RuntimeError", "rank 3 fails\nsecond line")
    wrapper = type("UnknownError", (Exception,), {"__module__": "tensorflow.python.framework.errors_impl"})
    assert faults.reason(wrapper, wrapper("no python error here")) == ("UnknownError", "no python error here")
