// A device plugin for the test node, as the NVIDIA device plugin serves a resource under its
// default "envvar" device-list strategy: it advertises -devices devices of -resource to the
// kubelet and answers Allocate with NVIDIA_VISIBLE_DEVICES=<the allocated device ids>, which the
// kubelet puts first in the container's environment. tests/e2e/node/test_node_gpu_paths.py checks
// that the running container still has that value after gpufence's webhook mutated the pod.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	devices []*pluginapi.Device
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *pluginapi.Empty, stream pluginapi.DevicePlugin_ListAndWatchServer) error {
	if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	<-stream.Context().Done() // the list never changes
	return nil
}

func (p *plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(c.DevicesIDs, ",")},
		})
	}
	return resp, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

func dial(ctx context.Context, socket string) (*grpc.ClientConn, error) {
	return grpc.DialContext(ctx, socket, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithBlock(),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", addr)
		}))
}

func main() {
	dir := flag.String("dir", pluginapi.DevicePluginPath, "the kubelet's device-plugins directory")
	resource := flag.String("resource", "", "the extended resource to serve, e.g. nvidia.com/mig-1g.10gb")
	count := flag.Int("devices", 4, "how many devices to advertise")
	prefix := flag.String("id-prefix", "GPU-sim-", "device ids: the prefix followed by 0, 1, ...")
	flag.Parse()
	if *resource == "" {
		log.Fatal("-resource is required")
	}
	p := &plugin{}
	for i := 0; i < *count; i++ {
		p.devices = append(p.devices, &pluginapi.Device{ID: fmt.Sprintf("%s%d", *prefix, i), Health: pluginapi.Healthy})
	}
	endpoint := strings.NewReplacer("/", "-", ".", "-").Replace(*resource) + ".sock"
	socket := filepath.Join(*dir, endpoint)
	_ = os.Remove(socket)
	listener, err := net.Listen("unix", socket)
	if err != nil {
		log.Fatalf("listen on %s: %v", socket, err)
	}
	server := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(server, p)
	go func() { _ = server.Serve(listener) }()

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if conn, err := dial(ctx, socket); err != nil { // serving before registering, as the kubelet expects
		log.Fatalf("own socket: %v", err)
	} else {
		conn.Close()
	}
	conn, err := dial(ctx, filepath.Join(*dir, "kubelet.sock"))
	if err != nil {
		log.Fatalf("kubelet socket: %v", err)
	}
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version: pluginapi.Version, Endpoint: endpoint, ResourceName: *resource,
	})
	conn.Close()
	if err != nil {
		log.Fatalf("register %s: %v", *resource, err)
	}
	log.Printf("serving %d devices of %s at %s", *count, *resource, socket)
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	<-stop
	server.Stop()
}
