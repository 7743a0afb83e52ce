"""Record and replay (docs/observability.md, "Record and replay"): `recorder.py` records every host
call an instance makes and what it got back; `format.py` is the file; `replay.py` re-runs a guest
against a recording with no model and no scheduler; `cli.py` is `pie-replay`. Import the modules
directly (`replay` and `cli` import no torch)."""
