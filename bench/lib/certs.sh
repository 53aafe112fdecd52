# Test certificates (sourced; openssl, ECDSA P-256, valid two days).
# make_certs DIR writes, in DIR: cert.pem / key.pem for the front door
# (bench.example and 127.0.0.1), and a private CA (ca.pem, ca.key) that
# signed backend.pem / backend.key for backend.example.
make_certs() { # dir
  local d=$1 ec=(-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes)
  {
    openssl req -x509 "${ec[@]}" -days 2 -subj "/CN=bench.example" \
      -addext "subjectAltName=DNS:bench.example,IP:127.0.0.1" -keyout "$d/key.pem" -out "$d/cert.pem"
    openssl req -x509 "${ec[@]}" -days 2 -subj "/CN=bench CA" -keyout "$d/ca.key" -out "$d/ca.pem"
    openssl req "${ec[@]}" -subj "/CN=backend.example" -keyout "$d/backend.key" -out "$d/backend.csr"
    printf 'subjectAltName=DNS:backend.example\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n' \
      > "$d/backend.ext"
    openssl x509 -req -in "$d/backend.csr" -CA "$d/ca.pem" -CAkey "$d/ca.key" -CAcreateserial -days 2 \
      -extfile "$d/backend.ext" -out "$d/backend.pem"
  } 2>/dev/null
}
