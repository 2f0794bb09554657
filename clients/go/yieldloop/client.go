// Package yieldloop is the Go client of yieldloop's gRPC services: the stubs generated from protos/ (gen/, by
// ./generate.sh) behind a thin layer like the Python client's: an API key on every call, TLS with the stack's
// CA, typed errors carrying the google.rpc.ErrorInfo reason, and FromDataDir for a running `yieldloop up`.
package yieldloop

import (
	"context"
	"encoding/json"
	"fmt"
	"io/ioutil"
	"path/filepath"
	"strings"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	checkpointv1 "yieldloop.dev/client/gen/yieldloop/checkpoint/v1"
	envv1 "yieldloop.dev/client/gen/yieldloop/env/v1"
	rolloutv1 "yieldloop.dev/client/gen/yieldloop/rollout/v1"
	trainerv1 "yieldloop.dev/client/gen/yieldloop/trainer/v1"
)

// Options say where the services are and how to reach them.
type Options struct {
	Env, Rollout, Trainer, Checkpoint string // host:port of each service ("" leaves that stub nil)
	APIKey                            string // sent as "authorization: Bearer <key>" with every call
	TLSCAFile                         string // PEM of the CA that signed the services' certificates ("": plaintext)
}

// Client holds a stub per service, over one connection each.
type Client struct {
	Env        envv1.EnvServiceClient
	Rollout    rolloutv1.RolloutServiceClient
	Trainer    trainerv1.TrainerServiceClient
	Checkpoint checkpointv1.CheckpointServiceClient
	Options    Options // what it was made with
	conns      []*grpc.ClientConn
}

// Error is a failed call: its gRPC code, the ErrorInfo reason (e.g. "MODEL_NOT_FOUND") and the field it blames.
type Error struct {
	Code    string
	Reason  string
	Field   string
	Message string
}

func (e *Error) Error() string { return fmt.Sprintf("%s (%s): %s", e.Code, e.Reason, e.Message) }

// AsError turns what a call returned into an *Error (nil for nil; the code's name as reason when the server
// sent no ErrorInfo).
func AsError(err error) *Error {
	if err == nil {
		return nil
	}
	st, _ := status.FromError(err)
	code := strings.ToUpper(toSnake(st.Code().String()))
	out := &Error{Code: code, Reason: code, Message: st.Message()}
	for _, detail := range st.Details() {
		if info, ok := detail.(*errdetails.ErrorInfo); ok {
			out.Reason = info.GetReason()
			out.Field = info.GetMetadata()["field"]
		}
	}
	return out
}

func toSnake(name string) string { // "NotFound" -> "Not_Found"; "OK" stays
	var b strings.Builder
	prev := rune(0)
	for _, r := range name {
		if r >= 'A' && r <= 'Z' && prev >= 'a' && prev <= 'z' {
			b.WriteByte('_')
		}
		b.WriteRune(r)
		prev = r
	}
	return b.String()
}

func withKey(ctx context.Context, key string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+key)
}

// New dials every service named in opts.
func New(opts Options) (*Client, error) {
	dialOpts := []grpc.DialOption{}
	if opts.TLSCAFile != "" {
		creds, err := credentials.NewClientTLSFromFile(opts.TLSCAFile, "")
		if err != nil {
			return nil, err
		}
		dialOpts = append(dialOpts, grpc.WithTransportCredentials(creds))
	} else {
		dialOpts = append(dialOpts, grpc.WithInsecure())
	}
	if opts.APIKey != "" {
		key := opts.APIKey
		dialOpts = append(dialOpts,
			grpc.WithUnaryInterceptor(func(ctx context.Context, method string, req, reply interface{},
				cc *grpc.ClientConn, invoker grpc.UnaryInvoker, callOpts ...grpc.CallOption) error {
				return invoker(withKey(ctx, key), method, req, reply, cc, callOpts...)
			}),
			grpc.WithStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn,
				method string, streamer grpc.Streamer, callOpts ...grpc.CallOption) (grpc.ClientStream, error) {
				return streamer(withKey(ctx, key), desc, cc, method, callOpts...)
			}))
	}
	c := &Client{Options: opts}
	dial := func(address string) (*grpc.ClientConn, error) {
		conn, err := grpc.Dial(address, dialOpts...)
		if err == nil {
			c.conns = append(c.conns, conn)
		}
		return conn, err
	}
	for _, s := range []struct {
		address string
		bind    func(*grpc.ClientConn)
	}{
		{opts.Env, func(cc *grpc.ClientConn) { c.Env = envv1.NewEnvServiceClient(cc) }},
		{opts.Rollout, func(cc *grpc.ClientConn) { c.Rollout = rolloutv1.NewRolloutServiceClient(cc) }},
		{opts.Trainer, func(cc *grpc.ClientConn) { c.Trainer = trainerv1.NewTrainerServiceClient(cc) }},
		{opts.Checkpoint, func(cc *grpc.ClientConn) { c.Checkpoint = checkpointv1.NewCheckpointServiceClient(cc) }},
	} {
		if s.address == "" {
			continue
		}
		conn, err := dial(s.address)
		if err != nil {
			c.Close()
			return nil, err
		}
		s.bind(conn)
	}
	return c, nil
}

// FromDataDir dials the stack `yieldloop up --data-dir DIR` runs: its ready files, admin key and CA.
func FromDataDir(dir string) (*Client, error) {
	opts := Options{}
	tls := false
	for _, service := range []string{"env", "rollout", "trainer", "checkpoint"} {
		data, err := ioutil.ReadFile(filepath.Join(dir, "run", service+".json"))
		if err != nil {
			return nil, fmt.Errorf("no running stack in %s: %v", dir, err)
		}
		var ready struct {
			Address string `json:"address"`
			TLS     bool   `json:"tls"`
		}
		if err := json.Unmarshal(data, &ready); err != nil {
			return nil, err
		}
		tls = tls || ready.TLS
		switch service {
		case "env":
			opts.Env = ready.Address
		case "rollout":
			opts.Rollout = ready.Address
		case "trainer":
			opts.Trainer = ready.Address
		case "checkpoint":
			opts.Checkpoint = ready.Address
		}
	}
	if key, err := ioutil.ReadFile(filepath.Join(dir, "api_key")); err == nil {
		opts.APIKey = strings.TrimSpace(string(key))
	}
	if tls {
		opts.TLSCAFile = filepath.Join(dir, "tls", "ca.pem")
	}
	return New(opts)
}

// Close closes the connections.
func (c *Client) Close() {
	for _, conn := range c.conns {
		conn.Close()
	}
	c.conns = nil
}
