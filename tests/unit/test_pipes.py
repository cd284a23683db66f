"""hivemind's control pipes under uvloop: a long message that arrives in parts is read whole (net/pipes.py).

The writer sends one message in two parts with a pause between them, as a busy host does; the reader's descriptor is
non-blocking, as uvloop's ``add_reader`` leaves it in hivemind's DHT and averager processes."""

import multiprocessing
import os
import pickle
import struct
import threading
import time

import pytest

from swarmrun.node.net.pipes import whole_messages

MESSAGE = ("_set_round_context", [5, {"applied": list(range(0, 400_000, 3))}], {})


def _send_in_two_parts(conn) -> threading.Thread:
    data = pickle.dumps(MESSAGE)
    frame = struct.pack("!i", len(data)) + data

    def write():
        os.write(conn.fileno(), frame[:1000])
        time.sleep(0.3)
        view = memoryview(frame)[1000:]
        while view:
            view = view[os.write(conn.fileno(), view):]

    thread = threading.Thread(target=write)
    thread.start()
    return thread


def test_a_plain_connection_tears_the_message_on_a_non_blocking_descriptor():
    host, process = multiprocessing.Pipe()
    os.set_blocking(process.fileno(), False)
    writer = _send_in_two_parts(host)
    assert process.poll(5)
    with pytest.raises(BlockingIOError):  # hivemind logs this, reads again from the middle, and dies on EOFError
        process.recv()
    os.set_blocking(process.fileno(), True)
    while writer.is_alive() or process.poll(0):  # drain the rest, so the writer finishes
        if process.poll(0.1):
            os.read(process.fileno(), 1 << 20)
    writer.join(10)


def test_whole_messages_reads_and_writes_it_whole():
    host, process = multiprocessing.Pipe()
    os.set_blocking(process.fileno(), False)
    wrapped = whole_messages(process)
    writer = _send_in_two_parts(host)
    assert wrapped.poll(5)
    assert wrapped.recv() == MESSAGE
    writer.join(10)
    reply = threading.Thread(target=wrapped.send, args=(MESSAGE,))  # and back: the reply of a long message too
    reply.start()
    assert host.recv() == MESSAGE
    reply.join(10)
    assert whole_messages(wrapped) is wrapped and wrapped.fileno() == process.fileno()
