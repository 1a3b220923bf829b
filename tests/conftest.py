"""Session-wide test set-up.

torch is imported here, at collection: on import it binds its log handler to the sys.stderr of that moment, and a
module whose first `import torch` happened inside a test with capsys would leave that handler writing to the test's
capture stream, closed after the test ("Logging error ... I/O operation on closed file" in a later test's output).
"""

import torch  # noqa: F401
