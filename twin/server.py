"""Starts moto (with twin/moto_ext.py) plus the twin's control API and Lambda shim.
Usage: python server.py MOTO_PORT CONTROL_PORT SHIM_PORT  (PGHYDRATE_TWIN_WATCH_URL must be set)."""
import os
import sys

moto_port, control_port, shim_port = (int(a) for a in sys.argv[1:4])
os.environ["PGHYDRATE_TWIN_LAMBDA_URL"] = f"http://127.0.0.1:{shim_port}"
os.environ["MOTO_PORT"] = str(moto_port)
sys.path.insert(0, os.path.dirname(__file__))
import moto_ext  # noqa: E402  (patches moto before the server starts)

moto_ext.serve_side_ports(control_port, shim_port)
from moto.server import main  # noqa: E402

main(["-H", "127.0.0.1", "-p", str(moto_port)])
