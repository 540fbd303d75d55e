# Shared by the device scripts (sourced): unpacks the carried, compressed binaries (devbin/, refbin/:
# NAME.xz, or NAME.gz from older preparations) into $BIN. xz keeps three fitmoe builds and all the
# fixtures under the 64 MiB carry limit; python3's lzma stands in where the machine has no xz.
unpack_bins() {
  local f n
  for f in "$@"; do
    [ -f "$f" ] || continue
    n=$(basename "$f")
    n=${n%.*}
    case "$f" in
      *.xz)
        if command -v xz >/dev/null; then xz -dc "$f"
        else python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' "$f"; fi ;;
      *.gz) gzip -dc "$f" ;;
      *) continue ;;
    esac > "$BIN/$n" && chmod +x "$BIN/$n"
  done
}
