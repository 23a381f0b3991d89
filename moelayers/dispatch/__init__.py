"""Dispatchers (steps 3 and 5): move tokens to their experts' ranks and back."""

from moelayers.dispatch.allgather import AllGatherDispatcher
from moelayers.dispatch.alltoall import AllToAllDispatcher
from moelayers.dispatch.base import Dispatcher, LocalFirstPolicy, Received, ReplicaPolicy, Routes

__all__ = ["AllGatherDispatcher", "AllToAllDispatcher", "Dispatcher", "LocalFirstPolicy", "Received", "ReplicaPolicy", "Routes"]
