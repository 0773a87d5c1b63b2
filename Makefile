# The two commands a newcomer needs (see README.md):
#   make demo   install, then run a 10-client FedAvg simulation on the embedded digits dataset
#   make test   install, then run the test suite
.PHONY: install demo test

install:
	bash scripts/install.sh

demo: install
	.venv/bin/python -m concatfl.launch --num-supernodes 10 --run-config "output-dir='outputs/demo'"

# Three workers (pytest-xdist) on two cores: the end-to-end tests spend much of their time waiting on
# the processes they start (heartbeat expiry, restart delays, round timeouts), which a third worker
# fills (the suite took 468 s instead of 564 s here); --dist loadfile keeps a file's tests, and a
# stack its module shares, in one worker.
test: install
	.venv/bin/python -m pytest -n 3 --dist loadfile
