"""A small authoritative DNS server for tests: answers A and SRV queries from a JSON zone file that
it reads again on every query, so a test changes the records by rewriting the file.

Usage: dns_server.py PORT ZONE.json [ADDR]

The zone: {"srv": {"NAME.": [["TARGET.", PORT], ...]}, "a": {"NAME.": ["IP", ...]}}. A name in
neither map gets NXDOMAIN; a known name with no records of the asked type gets an empty answer.
Records have TTL 0. Serves UDP and TCP on ADDR:PORT (default 127.0.0.1; PyPI's dnslib) and prints
"listening".
"""

import json
import sys
import time

from dnslib import QTYPE, RCODE, RR, A, SRV
from dnslib.server import BaseResolver, DNSLogger, DNSServer


class ZoneResolver(BaseResolver):
    def __init__(self, path):
        self.path = path

    def resolve(self, request, handler):
        reply = request.reply()
        try:
            with open(self.path, encoding="utf-8") as f:
                zone = json.load(f)
        except (OSError, ValueError):
            reply.header.rcode = RCODE.SERVFAIL
            return reply
        name = str(request.q.qname).lower()
        srv = zone.get("srv", {})
        a = zone.get("a", {})
        if name not in srv and name not in a:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        qtype = QTYPE[request.q.qtype]
        if qtype == "SRV":
            for target, port in srv.get(name, []):
                reply.add_answer(RR(request.q.qname, QTYPE.SRV, ttl=0, rdata=SRV(0, 10, port, target)))
        elif qtype == "A":
            for ip in a.get(name, []):
                reply.add_answer(RR(request.q.qname, QTYPE.A, ttl=0, rdata=A(ip)))
        return reply


def main():
    port, path = int(sys.argv[1]), sys.argv[2]
    addr = sys.argv[3] if len(sys.argv) > 3 else "127.0.0.1"
    resolver = ZoneResolver(path)
    logger = DNSLogger(log="-request,-reply,-truncated,-error,-recv,-send,-data", prefix=False)
    servers = [
        DNSServer(resolver, port=port, address=addr, logger=logger),
        DNSServer(resolver, port=port, address=addr, tcp=True, logger=logger),
    ]
    for s in servers:
        s.start_thread()
    print("listening", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
