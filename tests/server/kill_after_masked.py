"""`shoal client`, except that the node SIGKILLs itself right after its masked input is
accepted: test-side fault injection, so an end-to-end test loses a node exactly there."""

import os
import signal
import sys

from shoal.client import secure_node

_post = secure_node._post


async def _post_then_die(node, route: str, body: bytes) -> None:
    await _post(node, route, body)
    if route == "masked":
        os.kill(os.getpid(), signal.SIGKILL)


secure_node._post = _post_then_die

if __name__ == "__main__":
    from shoal.cli import main

    sys.argv[0] = "shoal"
    main()
