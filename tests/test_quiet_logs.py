"""train.py and eval.py keep absl's INFO records (Orbax: about 100 lines per checkpoint save) off
the console unless -v / --verbosity is given; Python's own logging records stay."""

import logging

import pytest
from absl import logging as absl_logging

from kimi_jax import logging_utils


@pytest.fixture
def levels():
    absl_logger, root = logging.getLogger("absl"), logging.getLogger()
    old = absl_logger.level, root.level
    root.setLevel(logging.INFO)
    absl_logger.setLevel(logging.NOTSET)
    yield absl_logger, root
    absl_logger.setLevel(old[0])
    root.setLevel(old[1])


def test_absl_info_is_dropped_unless_verbosity_is_given(levels, caplog):
    absl_logger, root = levels
    logging_utils.quiet_library_logs(verbosity_given=True)
    assert absl_logger.isEnabledFor(logging.INFO)
    logging_utils.quiet_library_logs(verbosity_given=False)
    with caplog.at_level(logging.INFO):
        absl_logging.info("saving checkpoint step 30")  # what Orbax writes
        absl_logging.warning("checkpoint slow")
        logging.info("evaluating workdir at step 30")  # eval.py's progress (root logger)
    messages = [r.getMessage() for r in caplog.records]
    assert "saving checkpoint step 30" not in messages
    assert "checkpoint slow" in messages and "evaluating workdir at step 30" in messages
    assert root.isEnabledFor(logging.INFO)
