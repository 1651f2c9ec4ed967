"""The programs: the ``greenroom`` command line (``run``, ``chat``, ``serve``, ``demo``,
``acp``), the terminal chat client and the ACP agent for editors."""
