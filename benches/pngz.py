#!/usr/bin/env python3
"""Recompresses a PNG written by usher::plot (stored, uncompressed deflate
blocks) with zlib, in place, so the results plot is small enough to commit."""
import struct
import sys
import zlib


def chunk(kind, body):
    return struct.pack('>I', len(body)) + kind + body + struct.pack('>I', zlib.crc32(kind + body) & 0xffffffff)


def main(path):
    data = open(path, 'rb').read()
    pos, chunks, idat = 8, [], b''
    while pos < len(data):
        n, = struct.unpack('>I', data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        pos += 12 + n
        if kind == b'IDAT':
            idat += body
        else:
            chunks.append((kind, body))
    out = data[:8] + chunk(*chunks[0]) + chunk(b'IDAT', zlib.compress(zlib.decompress(idat), 9))
    out += b''.join(chunk(k, b) for k, b in chunks[1:])
    open(path, 'wb').write(out)


if __name__ == '__main__':
    main(sys.argv[1])
